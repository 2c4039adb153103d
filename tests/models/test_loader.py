"""Checkpoint loading: every on-disk variant gives the same model, bad inputs give clear errors, dummy weights."""

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from rimuru.models import ModelConfig, fabricate, from_pretrained
from rimuru.models.fabricate import tiny_config
from tests.models.helpers import ResidentRunner

PROMPTS = {0: [5, 77, 301, 12, 9], 1: [400, 3, 250, 17, 88, 101]}


def logits_of(folder) -> torch.Tensor:
    loaded = from_pretrained(folder, dtype=torch.float32, progress=False)
    return ResidentRunner(loaded).step(PROMPTS, all_logits=True)


def assert_same_weights(folder_a, folder_b) -> None:
    """Bitwise-equal module weights and host experts (logits may differ in the last bit: GEMMs on CPU depend on
    the alignment of the buffers safetensors hands out)."""
    a, b = (from_pretrained(f, dtype=torch.float32, progress=False) for f in (folder_a, folder_b))
    state_a, state_b = a.model.state_dict(), b.model.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert a.experts.keys() == b.experts.keys()
    for i in a.experts:
        assert all(torch.equal(x, y) for x, y in zip(vars(a.experts[i]).values(), vars(b.experts[i]).values()))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    folder = fabricate(tmp_path_factory.mktemp("base"), arch="qwen2_moe", mlp_only_layers=(1,))
    return folder, logits_of(folder)


@pytest.mark.parametrize(
    "variant",
    [
        {"expert_layout": "fused"},
        {"prefix": "model.language_model."},
        {"num_shards": 3},
        {"num_shards": 2, "expert_layout": "fused", "prefix": "model.language_model."},
    ],
)
def test_layout_variants_give_same_logits(tmp_path, baseline, variant):
    folder = fabricate(tmp_path, arch="qwen2_moe", mlp_only_layers=(1,), **variant)
    assert_same_weights(folder, baseline[0])
    torch.testing.assert_close(logits_of(folder), baseline[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("spelling", ["num_local_experts", "rope_theta_top_level", "rope_scaling"])
def test_config_spellings_give_same_logits(tmp_path, baseline, spelling):
    folder = fabricate(tmp_path, arch="qwen2_moe", mlp_only_layers=(1,))
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    theta = cfg.pop("rope_parameters")["rope_theta"]
    if spelling == "num_local_experts":
        cfg["num_local_experts"] = cfg.pop("num_experts")
        cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    elif spelling == "rope_theta_top_level":
        cfg["rope_theta"] = theta
    else:
        cfg["rope_scaling"] = {"rope_theta": theta, "type": "default"}
    json.dump(cfg, open(path, "w"))
    torch.testing.assert_close(logits_of(folder), baseline[1], atol=1e-5, rtol=0)


def test_transposed_fused_experts_are_reoriented(tmp_path, baseline):
    """Qwen3-VL-MoE stores gate_up_proj [E, D, 2F]; accepted when the shape is unambiguous (here F = 24)."""
    over = {"moe_intermediate_size": 24}
    ref = logits_of(fabricate(tmp_path / "ref", arch="qwen3_moe", config_overrides=over, expert_layout="fused"))
    folder = fabricate(tmp_path / "t", arch="qwen3_moe", config_overrides=over, expert_layout="fused")
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v) for k, v in load_file(path).items()}
    save_file(tensors, path)
    torch.testing.assert_close(logits_of(folder), ref, atol=1e-5, rtol=0)


def test_host_experts_hold_checkpoint_tensors(baseline):
    loaded = from_pretrained(baseline[0], dtype=torch.float32, progress=False)
    tensors = load_file(os.path.join(baseline[0], "model.safetensors"))
    assert loaded.config.moe_layer_ids == [0, 2] and sorted(loaded.experts) == [0, 2]
    gate, up, down = loaded.experts[2].matrices(5)
    assert torch.equal(gate, tensors["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(up, tensors["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(down, tensors["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert loaded.tokenizer_path == baseline[0]


def test_missing_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        from_pretrained(missing)


def test_folder_without_weights_says_what_was_looked_for(tmp_path):
    json.dump(tiny_config(), open(tmp_path / "config.json", "w"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained(tmp_path)


def test_uncached_repo_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"hf download rimuru-test/not-a-model"):
        from_pretrained("rimuru-test/not-a-model")
    assert time.monotonic() - start < 5


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    folder = fabricate(tmp_path, arch="qwen3_moe")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"2 missing.*q_norm.*experts\.3\.up_proj.*1 unexpected.*bogus"):
        from_pretrained(folder, progress=False)


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path):
    folder = fabricate(tmp_path, arch="qwen2_moe")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)  # 2 heads x 16 rows expected
    save_file(tensors, path)
    wrong = r"1 missing.*k_proj.*1 unexpected.*k_proj.weight of shape \[8, 64\], not \[32, 64\]"
    with pytest.raises(ValueError, match=wrong):
        from_pretrained(folder, progress=False)


def test_a_folder_without_a_config_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"^checkpoint folder '{tmp_path}' has no config.json$"):
        ModelConfig.from_hf(tmp_path)


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="unsupported architecture 'llama'"):
        ModelConfig.from_hf(tiny_config() | {"model_type": "llama"})


def test_moe_layer_rule():
    cfg = ModelConfig.from_hf(tiny_config(num_layers=6, mlp_only_layers=(3,)) | {"decoder_sparse_step": 2})
    assert cfg.moe_layer_ids == [1, 5]
    assert ModelConfig.from_hf(tiny_config("qwen3_moe")).shared_expert_intermediate_size == 0


def test_dummy_weights_are_deterministic_and_experts_on_host(tmp_path):
    folder = tmp_path / "cfg"
    folder.mkdir()
    json.dump(tiny_config("qwen3_moe"), open(folder / "config.json", "w"))
    a = from_pretrained(folder, load_format="dummy", dtype=torch.float32)
    b = from_pretrained(folder, load_format="dummy", dtype=torch.float32)
    assert torch.equal(a.experts[0].down, b.experts[0].down)
    assert torch.equal(a.model.model.layers[1].mlp.gate.weight, b.model.model.layers[1].mlp.gate.weight)
    assert a.experts[0].gate.device.type == "cpu"
    assert torch.isfinite(ResidentRunner(a).step(PROMPTS)).all()


def test_a_hybrids_dummy_norms_scale_by_one(tmp_path):
    """A hybrid's norms store their weight around zero (x̂ · (1 + w)) but for its linear attention's gated norm
    (x̂ · w): dummy weights make every one of them scale by one, as the other families' norms at 1 do."""
    fabricate(tmp_path, arch="qwen3_next")
    loaded = from_pretrained(tmp_path, load_format="dummy", dtype=torch.float32)
    norms = {name: module for name, module in loaded.model.named_modules() if name.endswith("norm")}
    gated = [module for name, module in norms.items() if name.endswith("linear_attn.norm")]
    assert gated and len(gated) < len(norms)
    for module in norms.values():
        x = torch.randn(3, module.weight.shape[0])
        scaled = module(x, torch.full_like(x, 50.0)) if module in gated else module(x)  # silu(50) = 50
        factor = 50.0 if module in gated else 1.0
        expected = factor * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)
        torch.testing.assert_close(scaled, expected, rtol=1e-4, atol=1e-4)


def test_router_skew_concentrates_routing(tmp_path):
    """With skew 2 the favourite expert of a layer takes far more than its uniform share of top-1 picks."""
    json.dump(tiny_config("qwen3_moe") | {"num_experts": 16}, open(tmp_path / "config.json", "w"))
    shares = {}
    for skew in (0.0, 2.0):
        loaded = from_pretrained(tmp_path, load_format="dummy", router_skew=skew, dtype=torch.float32)
        counts = torch.zeros(16)

        def count(layer_idx, hidden, topk_ids, counts=counts):
            counts.add_(torch.bincount(topk_ids[:, 0], minlength=16).float())

        ResidentRunner(loaded, max_requests=1, max_pages=64, on_routing=count).step({0: list(range(1, 200))})
        shares[skew] = (counts.max() / counts.sum()).item()
    print(shares)
    assert shares[2.0] > 0.3 > shares[0.0]


def test_router_regimes_move_popularity_with_the_tokens(tmp_path):
    """Two regimes: prompts from either half of the vocabulary favour different experts in every layer, and the
    model's next token stays in its prompt's half (so decoding keeps the regime)."""
    from rimuru.models.dummy import regime_rows

    config = tiny_config("qwen3_moe") | {"num_experts": 16}
    json.dump(config, open(tmp_path / "config.json", "w"))
    loaded = from_pretrained(tmp_path, load_format="dummy", router_skew=2.0, router_regimes=2, dtype=torch.float32)
    halves = regime_rows(config["vocab_size"], 2)
    gen = torch.Generator().manual_seed(0)
    favourites, next_tokens = [], []
    for half in halves:
        counts = torch.zeros(config["num_hidden_layers"], 16)

        def count(layer_idx, hidden, topk_ids, counts=counts):
            counts[layer_idx] += torch.bincount(topk_ids[:, 0], minlength=16).float()

        prompt = torch.randint(half.start, half.stop, (200,), generator=gen).tolist()
        logits = ResidentRunner(loaded, max_requests=1, max_pages=64, on_routing=count).step({0: prompt})
        moe = counts[loaded.config.moe_layer_ids]  # [L, E]
        assert (moe.max(1).values / moe.sum(1) > 0.3).all()  # skewed within the regime
        favourites.append(moe.argmax(1))
        next_tokens.append(int(logits[-1].argmax()))
    assert (favourites[0] != favourites[1]).any()  # the favourites move with the tokens
    assert all(half.start <= token < half.stop for half, token in zip(halves, next_tokens))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_every_parameter_is_the_tensor_allocated_before_loading(baseline, load_format, monkeypatch):
    """A weight replaced after loading (stacked anew, padded, cast) frees its first tensor: on a GPU the caching
    allocator keeps that hole reserved beside the pool, over the budget. The stacked shared-expert projection's
    padding rows are zero."""
    import rimuru.models.loader as loader

    allocated, allocate = {}, loader._allocate

    def recording(model, device, dtype):
        params, weights = allocate(model, device, dtype)
        allocated.update({name: t.data_ptr() for name, t in params.items()})
        return params, weights

    monkeypatch.setattr(loader, "_allocate", recording)
    model = from_pretrained(baseline[0], load_format=load_format, progress=False).model
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == allocated
    block = next(layer.mlp for layer in model.model.layers if getattr(layer.mlp, "shared_expert", None) is not None)
    rows = 2 * block.shared_expert.intermediate_size + 1
    assert block.shared_expert.gate_up_gate_proj.weight[rows:].eq(0).all()
