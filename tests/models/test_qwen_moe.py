"""Rimuru's Qwen MoE models against Hugging Face transformers on fabricated checkpoints (CPU, fp32)."""

import pytest
import torch

from rimuru.models import fabricate, from_pretrained
from tests.models.helpers import ResidentRunner, hf_logits, load_hf_reference

ATOL = 1e-4
PROMPTS = [
    [5, 77, 301, 12, 9],
    [400, 3, 3, 250, 17, 88, 101, 64, 2],
    [42, 7],
    [11, 200, 33, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    arch = request.param
    mlp_only = (1,) if arch == "qwen2_moe" else ()
    return fabricate(tmp_path_factory.mktemp(arch), arch=arch, seed=0, mlp_only_layers=mlp_only)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_reference(checkpoint)


@pytest.fixture()
def loaded(checkpoint):
    return from_pretrained(checkpoint, device="cpu", dtype=torch.float32, progress=False)



def test_prefill_batch_matches_hf(loaded, hf_model):
    runner = ResidentRunner(loaded)
    logits = runner.step(dict(enumerate(PROMPTS)), all_logits=True)  # [T, V]
    expected = torch.cat([hf_logits(hf_model, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_steps_match_hf(loaded, hf_model):
    runner = ResidentRunner(loaded)
    seqs = [list(p) for p in PROMPTS]
    logits = runner.step(dict(enumerate(seqs)))  # [B, V], each prompt's last token
    for _ in range(4):
        expected = torch.stack([hf_logits(hf_model, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        next_tokens = expected.argmax(-1).tolist()
        for seq, tok in zip(seqs, next_tokens):
            seq.append(tok)
        logits = runner.step({r: [tok] for r, tok in enumerate(next_tokens)})


def test_chunked_prefill_mixed_with_decode_matches_hf(loaded, hf_model):
    """Request 0 decodes while request 1's prompt arrives in two chunks; pages cross chunk boundaries."""
    runner = ResidentRunner(loaded)
    long_prompt = PROMPTS[3]
    runner.step({0: PROMPTS[0], 1: long_prompt[:6]})
    logits = runner.step({0: [99], 1: long_prompt[6:]})  # [2, V]
    expected = torch.stack([hf_logits(hf_model, PROMPTS[0] + [99])[-1], hf_logits(hf_model, long_prompt)[-1]])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_greedy_text_is_not_degenerate(loaded, hf_model):
    """Fabricated weights give distinct predictions whose top-1 margins dwarf the fp32 disagreement (~1e-6)."""
    last = torch.stack([hf_logits(hf_model, p)[-1] for p in PROMPTS])  # [B, V]
    top2 = last.topk(2, dim=-1).values
    assert len(set(last.argmax(-1).tolist())) >= 3
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_swapping_expert_pages_changes_logits(loaded):
    """The comparison is not vacuous: pointing an expert at another expert's pages changes the output."""
    runner = ResidentRunner(loaded)
    before = runner.step({0: PROMPTS[1]}, all_logits=True)
    layer = loaded.config.moe_layer_ids[0]
    table = runner.expert_page_tables[layer]
    table[[0, 1]] = table[[1, 0]].clone()
    runner.seq_lens = [0] * runner.max_requests
    after = runner.step({0: PROMPTS[1]}, all_logits=True)
    assert (before - after).abs().max() > 1e-2


def test_on_routing_called_once_per_moe_layer(loaded):
    runner = ResidentRunner(loaded)
    runner.step({0: PROMPTS[0], 1: PROMPTS[2]})
    cfg = loaded.config
    num_tokens = len(PROMPTS[0]) + len(PROMPTS[2])
    expected = [(i, (num_tokens, cfg.hidden_size), (num_tokens, cfg.num_experts_per_tok)) for i in cfg.moe_layer_ids]
    assert runner.routing_calls == expected


def test_padding_rows_route_like_row_zero_and_leave_real_rows_alone(loaded):
    """A CUDA graph's padding rows (`ForwardContext.padding_rows`) take row 0's experts in every MoE layer; the
    real rows' logits do not change."""
    chunks = {0: PROMPTS[0], 1: PROMPTS[2]}  # 7 tokens; the last 2 play padding
    plain = ResidentRunner(loaded).step(chunks, all_logits=True)
    runner = ResidentRunner(loaded)
    ctx = runner.context(chunks, all_logits=True)
    ctx.padding_rows = torch.tensor([False] * 5 + [True] * 2)
    routed = []
    ctx.on_routing = lambda layer, hidden, topk_ids: routed.append(topk_ids.clone())
    input_ids = torch.tensor([t for toks in chunks.values() for t in toks])
    with torch.no_grad():
        padded = loaded.model(input_ids, ctx)
    assert routed and all(torch.equal(ids[5:], ids[:1].expand(2, -1)) for ids in routed)
    torch.testing.assert_close(padded[:5], plain[:5])


def test_module_holds_no_routed_experts(loaded):
    names = [name for name, _ in loaded.model.named_parameters()]
    assert not any(".experts." in n for n in names)
    assert sorted(loaded.experts) == loaded.config.moe_layer_ids
    weights = loaded.experts[loaded.config.moe_layer_ids[0]]
    cfg = loaded.config
    assert weights.gate.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert weights.down.shape == (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    assert weights.gate.device.type == "cpu"


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen3_moe", {"tie_word_embeddings": True, "attention_bias": True, "norm_topk_prob": False}),
        ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True, "num_key_value_heads": 4}),
    ],
)
def test_config_switches_match_hf(tmp_path, arch, overrides):
    folder = fabricate(tmp_path, arch=arch, config_overrides=overrides)
    hf = load_hf_reference(folder)
    loaded = from_pretrained(folder, dtype=torch.float32, progress=False)
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == overrides.get("tie_word_embeddings", False)
    logits = ResidentRunner(loaded).step(dict(enumerate(PROMPTS[:3])), all_logits=True)
    expected = torch.cat([hf_logits(hf, p) for p in PROMPTS[:3]])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
