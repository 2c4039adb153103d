"""The `rimuru::` ops on CPU: dispatch to the references, `opcheck`, and tracing under torch.compile(fullgraph)."""

import pytest
import torch
from ops_cases import MIXED_BATCH, attention_case, moe_case

import rimuru.ops as ops
from rimuru.ops import reference


def test_dispatch_cpu_runs_references():
    case = moe_case(5, 6, 2, 24, 40)
    torch.testing.assert_close(ops.paged_moe(*case.args()), reference.paged_moe(*case.args()), rtol=0, atol=0)
    att = attention_case(MIXED_BATCH, 4, 2, 16, 4)
    torch.testing.assert_close(ops.paged_attention(*att.args()), reference.paged_attention(*att.args()))


def test_write_kv_mutates_the_pool_view():
    att = attention_case([(0, 0)], 2, 2, 8, 4, spare_pages=3)
    key, value = torch.randn(2, 2, 2, 8).unbind(0)
    ops.write_kv(key, value, att.kv_view, torch.tensor([5, -1]))
    torch.testing.assert_close(att.kv_view[1, 0, 1], key[0])
    torch.testing.assert_close(att.kv_view[1, 1, 1], value[0])
    assert torch.isnan(att.kv_view._base[:, att.kv_view[0].numel():]).all()


def test_opcheck_paged_moe():
    case = moe_case(7, 5, 2, 24, 40, identity=True)
    torch.library.opcheck(torch.ops.rimuru.paged_moe.default, case.args())


def test_opcheck_paged_attention():
    att = attention_case(MIXED_BATCH[:4], 4, 2, 16, 4)
    torch.library.opcheck(torch.ops.rimuru.paged_attention.default, att.args())


def test_opcheck_rms_norm():
    torch.library.opcheck(torch.ops.rimuru.rms_norm.default, (torch.randn(5, 3, 24), torch.randn(24), 1e-6))


def test_opcheck_fused_elementwise():
    x, residual, weight = torch.randn(5, 24), torch.randn(5, 24), torch.randn(24)
    torch.library.opcheck(torch.ops.rimuru.add_rms_norm.default, (x, residual, weight, 1e-6))
    torch.library.opcheck(torch.ops.rimuru.silu_and_mul.default, (torch.randn(5, 16),))
    torch.library.opcheck(torch.ops.rimuru.sigmoid_gated_add.default, (x, torch.randn(5, 1), residual))


def test_rope_matches_transformers():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb

    q, k = torch.randn(2, 7, 4, 16, dtype=torch.bfloat16).unbind(0)  # [T, H, Dh]
    angles = torch.randn(7, 8).repeat(1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ours = reference.rope(q, k, cos, sin)  # what rope_write_kv rotates by
    assert torch.equal(ours[0], hf_q[0].transpose(0, 1)) and torch.equal(ours[1], hf_k[0].transpose(0, 1))


def test_opcheck_topk_softmax():
    for renormalize in (False, True):
        torch.library.opcheck(torch.ops.rimuru.topk_softmax.default, (torch.randn(6, 60), 4, renormalize))
    padding = torch.tensor([False, False, True, False, True, True])
    torch.library.opcheck(torch.ops.rimuru.topk_softmax.default, (torch.randn(6, 60), 4, True, padding))


def test_rms_norm_matches_transformers():
    """The reference is transformers' Qwen2/Qwen3 RMSNorm, to the bit, in fp32 and bf16."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        norm = Qwen3MoeRMSNorm(72, eps=1e-6).to(dtype)
        torch.nn.init.normal_(norm.weight)
        x = torch.randn(9, 72).to(dtype)
        assert torch.equal(ops.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach())


def test_opcheck_write_kv():
    kv_view = torch.randn(6, 2, 4, 2, 8)
    key, value = torch.randn(2, 3, 2, 8).unbind(0)
    torch.library.opcheck(torch.ops.rimuru.write_kv.default, (key, value, kv_view, torch.tensor([1, 9, -1])))


def test_opcheck_rope_write_kv():
    qkv, kv_view = torch.randn(3, (4 + 2 * 2) * 8), torch.randn(6, 2, 4, 2, 8)
    angles = torch.randn(3, 4).repeat(1, 2)
    for weights in ((torch.randn(8), torch.randn(8)), (None, None)):
        args = (qkv, *weights, 1e-6, angles.cos(), angles.sin(), kv_view, torch.tensor([1, 9, -1]), 4, 2)
        torch.library.opcheck(torch.ops.rimuru.rope_write_kv.default, args)


def _layer(query, key, value, kv_view, slots, table, seq_lens, qsl, hidden, experts, experts_table, ids, weights):
    ops.write_kv(key, value, kv_view, slots)
    attn = ops.paged_attention(query, kv_view, table, seq_lens, qsl, 0.25)
    return attn.sum() + ops.paged_moe(hidden, experts, experts_table, ids, weights, 24)


def _new_token_slots(att, requests):
    """Slots of each request's new tokens (the last ones of its sequence), from its page table."""
    slots = []
    for b, (ctx, new) in enumerate(requests):
        for pos in range(ctx, ctx + new):
            slots.append(int(att.page_table[b, pos // 4]) * 4 + pos % 4)
    return torch.tensor(slots)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_traces_the_ops(backend):
    requests = [(3, 2), (6, 1)]
    att = attention_case(requests, 4, 2, 16, page_tokens=4, spare_pages=2)
    moe = moe_case(3, 5, 2, 24, 40, identity=True)
    key, value = torch.randn(2, 3, 2, 16).unbind(0)
    args = (att.query, key, value, att.kv_view, _new_token_slots(att, requests), att.page_table, att.seq_lens,
            att.query_start_loc, moe.hidden, moe.expert_view, moe.page_table, moe.topk_ids, moe.topk_weights)
    expected = _layer(*[a.clone() if a is att.kv_view else a for a in args])
    compiled = torch.compile(_layer, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(*args), expected)


def test_h200_table_covers_both_models_and_lookup_picks_the_bucket_below():
    from rimuru.ops.configs import load_table, lookup

    table = load_table("NVIDIA H200")
    for shape in ("E=128,F=768,D=2048", "E=60,F=1408,D=2048"):
        assert sorted(int(m) for m in table[shape]) == [2**i for i in range(13)]
        assert lookup(table[shape], 3000) == table[shape]["2048"]
        assert lookup(table[shape], 1) == table[shape]["1"]
        for cfg in table[shape].values():
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= cfg.keys()


def test_a_gpu_without_a_table_takes_its_architectures_and_others_none():
    from rimuru.ops.configs import device_table, load_table

    h200 = load_table("NVIDIA H200")
    assert device_table("NVIDIA H200", (9, 0)) is h200
    assert device_table("NVIDIA H100 80GB HBM3", (9, 0)) is h200
    assert device_table("NVIDIA A100-SXM4-80GB", (8, 0)) == {}


@pytest.mark.parametrize("num_requests,num_kv_heads,max_kv_tokens,num_splits", [
    (64, 4, 1024, 1),  # 256 programs, about two an SM: the unsplit kernel
    (32, 4, 40960, 2),  # 128 programs, under 1.5 an SM: split at least in two
    (16, 4, 40960, 2),  # 64 programs: two splits give 128, the most under 132
    (8, 4, 4096, 4),  # 32 -> 128
    (4, 4, 2048, 8),  # 16 -> 128
    (8, 16, 8192, 2),  # Qwen1.5-MoE's 16 kv heads: 128 programs
    (256, 4, 1024, 1),  # enough programs already: the unsplit kernel
    (2, 4, 128, 2),  # 8 programs want 16 splits; a 128-token table holds two 64-token splits
    (1, 4, 64, 1),  # one tile of context: nothing to split
    (1, 1, 1 << 20, 64),  # capped
    (1, 4, 8192, 32),  # B=1: 4 programs -> 128
])
def test_decode_splits_fill_an_h200_from_shapes(num_requests, num_kv_heads, max_kv_tokens, num_splits):
    from rimuru.ops.split_kv_attention import decode_splits

    assert decode_splits(num_requests, num_kv_heads, max_kv_tokens, sms=132) == num_splits
