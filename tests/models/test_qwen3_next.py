"""Qwen3-Next and Qwen3.5 (the hybrid families: Gated DeltaNet and gated attention layers, routed plus shared
experts) against Hugging Face transformers' torch path on fabricated checkpoints (CPU, fp32): prefill, decode and
chunked prefill carry the linear layers' state through SSM and conv pages exactly. Qwen3.5's composite checkpoint
(vision tower and MTP head beside the text model) is held against transformers' text model on the same weights."""

import json
import logging

import pytest
import torch

from rimuru.models import ModelConfig, fabricate, from_pretrained
from tests.models.helpers import ResidentRunner, hf_logits, load_hf_reference

ATOL = 1e-4
PROMPTS = [[5, 77, 301, 12, 9], [400, 3, 3, 250, 17, 88, 101, 64, 2], [42], [11, 200, 33, 4, 5, 6, 7, 8, 9, 10, 11]]


VARIANTS = [("qwen3_next", "fused"), ("qwen3_next", "per_expert"), ("qwen3_5_moe_text", "fused"),
            ("qwen3_5_moe", "per_expert")]  # fmt: skip


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def checkpoints(request, tmp_path_factory):
    """(checkpoint, the text-only checkpoint of the same weights that transformers loads as the reference)."""
    arch, layout = request.param
    folder = fabricate(tmp_path_factory.mktemp(arch), arch=arch, seed=0, expert_layout=layout)
    if arch != "qwen3_5_moe":
        return folder, folder
    return folder, fabricate(tmp_path_factory.mktemp("text"), arch="qwen3_5_moe_text", seed=0, expert_layout=layout)


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints[0]


@pytest.fixture(scope="module")
def hf_model(checkpoints):
    return load_hf_reference(checkpoints[1])


@pytest.fixture()
def loaded(checkpoint):
    return from_pretrained(checkpoint, device="cpu", dtype=torch.float32, progress=False)



def test_prefill_batch_matches_hf(loaded, hf_model):
    logits = ResidentRunner(loaded).step(dict(enumerate(PROMPTS)), all_logits=True)  # [T, V]
    expected = torch.cat([hf_logits(hf_model, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_steps_match_hf(loaded, hf_model):
    runner = ResidentRunner(loaded)
    seqs = [list(p) for p in PROMPTS]
    logits = runner.step(dict(enumerate(seqs)))  # [B, V]
    for _ in range(4):
        expected = torch.stack([hf_logits(hf_model, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        next_tokens = expected.argmax(-1).tolist()
        for seq, tok in zip(seqs, next_tokens):
            seq.append(tok)
        logits = runner.step({r: [tok] for r, tok in enumerate(next_tokens)})


def test_chunked_prefill_beside_a_decode_matches_hf(loaded, hf_model):
    """Request 1's prompt arrives in three chunks while request 0 decodes: its state crosses each boundary."""
    runner = ResidentRunner(loaded)
    long_prompt = PROMPTS[3]
    runner.step({0: PROMPTS[0], 1: long_prompt[:4]})
    runner.step({0: [99], 1: long_prompt[4:5]})
    logits = runner.step({0: [7], 1: long_prompt[5:]})
    expected = torch.stack([hf_logits(hf_model, PROMPTS[0] + [99, 7])[-1], hf_logits(hf_model, long_prompt)[-1]])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_config_reads_the_hybrid_layout():
    raw = {"model_type": "qwen3_next", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 4,
           "num_attention_heads": 2, "moe_intermediate_size": 4, "num_experts_per_tok": 1, "num_experts": 2,
           "full_attention_interval": 4, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
           "linear_key_head_dim": 4, "linear_value_head_dim": 4, "shared_expert_intermediate_size": 4,
           "partial_rotary_factor": 0.25}  # fmt: skip
    config = ModelConfig.from_hf(raw)
    assert config.linear_layer_ids == [0, 1, 2] and config.layer_types[3] == "full_attention"
    assert config.attention_layer_ids == [3]  # the only layer with KV pages
    assert config.partial_rotary_factor == 0.25 and config.shared_expert_intermediate_size == 4
    with pytest.raises(ValueError, match="layer_types holds \\['sliding_attention'\\]"):
        ModelConfig.from_hf(raw | {"layer_types": ["sliding_attention"] * 4})


def test_qwen35_configs_read_as_their_text_model(tmp_path):
    composite = ModelConfig.from_hf(fabricate(tmp_path / "c", arch="qwen3_5_moe"))
    text = ModelConfig.from_hf(fabricate(tmp_path / "t", arch="qwen3_5_moe_text"))
    assert composite == text and composite.architecture == "qwen3_5_moe" and composite.linear_layer_ids == [0, 2]
    raw = json.loads((tmp_path / "t" / "config.json").read_text())
    with pytest.raises(ValueError, match="^mamba_ssm_dtype 'bfloat16': Rimuru keeps the linear-attention state in"):
        ModelConfig.from_hf(raw | {"mamba_ssm_dtype": "bfloat16"})


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_a_config_without_the_routing_and_rotary_fields_reads_as_transformers_does(tmp_path, arch):
    """Qwen3.5's published config has no `norm_topk_prob` (its router always renormalises) and may leave out the
    rotary share (a quarter of each head in transformers' configs): the logits stay Hugging Face's."""
    folder = fabricate(tmp_path, arch=arch, seed=0)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("norm_topk_prob"), raw.pop("partial_rotary_factor", None), raw["rope_parameters"].pop("partial_rotary_factor")
    path.write_text(json.dumps(raw))
    loaded = from_pretrained(folder, device="cpu", dtype=torch.float32, progress=False)
    assert loaded.config.norm_topk_prob and loaded.config.partial_rotary_factor == 0.25
    ours = ResidentRunner(loaded).step({0: PROMPTS[1]}, all_logits=True)
    torch.testing.assert_close(ours, hf_logits(load_hf_reference(folder), PROMPTS[1]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("field, value, message", [
    ("linear_num_value_heads", 3, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("attn_output_gate", False, "attn_output_gate false: Rimuru runs a hybrid's full-attention layers gated only"),
])  # fmt: skip
def test_a_head_split_the_kernels_do_not_serve_is_refused_naming_the_field(tmp_path, field, value, message):
    fabricate(tmp_path, arch="qwen3_next")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["linear_num_key_heads"], raw["num_attention_heads"]) == (2, 4)  # the fabricated split the cases break
    with pytest.raises(ValueError, match=f"^{message}"):
        ModelConfig.from_hf(raw | {field: value})


def test_the_composite_checkpoint_skips_what_the_text_model_does_not_run(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rimuru"):
        from_pretrained(fabricate(tmp_path, arch="qwen3_5_moe"), progress=False)
    assert "skipped 2 tensors of the vision tower and the multi-token-prediction head" in caplog.text
