"""`ref` vs `tri` for every Triton kernel, on CPU under the Triton interpreter, in fp32.

Run by `test_interpreter.py` in a subprocess with TRITON_INTERPRET=1 (the variable is read when a kernel is
decorated, so it must be set before `rimuru.ops` is first imported; a subprocess keeps it out of other tests).
By hand: `TRITON_INTERPRET=1 python -m pytest tests/ops/interp_kernels.py`.
"""

import importlib
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton kernels are defined", allow_module_level=True)

from ops_cases import MIXED_BATCH, attention_case, moe_case, runs_in_pair_order  # noqa: E402

from rimuru.ops import (
    moe_align,  # noqa: E402
    reference,  # noqa: E402
)
from rimuru.ops.activations import sigmoid_gated_add_triton, silu_and_mul_triton  # noqa: E402
from rimuru.ops.decode_attention import decode_attention_triton, decode_config  # noqa: E402
from rimuru.ops.linear_attention import causal_conv1d_step_triton, gated_delta_step_triton  # noqa: E402
from rimuru.ops.moe_align import (  # noqa: E402
    MAX_SORT_PROGRAMS,
    align_tokens_torch,
    align_tokens_triton,
    count_chunk,
    scans_counts,
    sort_chunks,
)
from rimuru.ops.paged_attention import paged_attention_triton  # noqa: E402
from rimuru.ops.paged_moe import paged_moe_triton  # noqa: E402
from rimuru.ops.rms_norm import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from rimuru.ops.rope_write_kv import rope_write_kv_triton  # noqa: E402
from rimuru.ops.topk_softmax import topk_softmax_triton  # noqa: E402
from rimuru.ops.topk_sum import topk_sum_triton  # noqa: E402
from rimuru.ops.write_kv import write_kv_triton  # noqa: E402

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
SHAPES = [(1, 4, 1), (1, 60, 4), (3, 4, 2), (3, 60, 4), (17, 4, 4), (17, 60, 2), (130, 4, 2), (130, 60, 4),
          (130, 60, 1)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k", SHAPES)
def test_paged_moe(num_tokens, num_experts, top_k):
    case = moe_case(num_tokens, num_experts, top_k, num_features=40, hidden_size=72, seed=num_tokens + num_experts)
    ref = reference.paged_moe(*case.args())
    tri = paged_moe_triton(*case.args(), config=SMALL)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [17, 1])  # 1: one block a pair, no sort
def test_paged_moe_skips_experts_not_in_the_pool(num_tokens):
    """Experts whose pages are -1 add nothing, and nothing is read for them: equal to the same routing with their
    router weights set to zero (the case a CUDA graph's padding rows are in)."""
    case = moe_case(num_tokens, 8, 2, num_features=40, hidden_size=72, seed=5)
    absent = case.topk_ids[0, :1] if num_tokens == 1 else torch.tensor([1, 6])
    case.page_table[absent] = -1
    zeroed_weights = case.topk_weights.masked_fill(torch.isin(case.topk_ids, absent), 0.0)
    present = case.page_table.clone()
    present[absent] = case.page_table[0]  # any readable pages: their rows are weighted by zero
    expected = reference.paged_moe(case.hidden, case.expert_view, present, case.topk_ids, zeroed_weights, 40)
    for out in (reference.paged_moe(*case.args()), paged_moe_triton(*case.args(), config=SMALL)):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (17, 8, 2), (130, 60, 4)])
def test_paged_moe_reads_host_copies_of_experts_not_in_the_pool(num_tokens, num_experts, top_k):
    """Experts at -1 read from host tensors ([E, F, D] gate and up, [E, D, F] down) give what the pool gives."""
    case = moe_case(num_tokens, num_experts, top_k, num_features=40, hidden_size=72, seed=num_tokens)
    ref = reference.paged_moe(*case.args())
    pages = case.page_table.long()
    host = tuple(case.expert_view[pages[:, m]].view(num_experts, *shape).clone()
                 for m, shape in enumerate([(40, 72), (40, 72), (72, 40)]))  # fmt: skip
    absent = torch.randperm(num_experts, generator=torch.Generator().manual_seed(1))[: num_experts // 2]
    case.page_table[absent] = -1
    case.expert_view[pages[absent].flatten()] = float("nan")  # their pool pages must not be read any more
    for tri in (reference.paged_moe(*case.args(), host), paged_moe_triton(*case.args(), config=SMALL, host=host)):
        torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_m", [16, 32])
def test_paged_moe_identity_and_tiles(block_m):
    case = moe_case(33, 8, 2, num_features=40, hidden_size=72, identity=True)
    ref = reference.paged_moe(*case.args())
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1,
           "DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 32}
    tri = paged_moe_triton(*case.args(), config=cfg)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(3, 4, 2), (5, 8, 4), (17, 60, 4)])
def test_paged_moe_pair_blocks_for_several_tokens(num_tokens, num_experts, top_k, monkeypatch):
    """`PAIR_BLOCKS` (a tuned config's choice for a few tokens): one M block a pair, no sort, experts that several
    tokens share read once a pair (4 experts, 3 tokens x 2: some are shared) give the sorted layout's output."""
    case = moe_case(num_tokens, num_experts, top_k, num_features=40, hidden_size=72, seed=num_tokens)
    assert case.topk_ids.unique().numel() < case.topk_ids.numel() or num_experts == 60
    ref = reference.paged_moe(*case.args())

    def no_sort(*args, **kwargs):
        raise AssertionError("PAIR_BLOCKS: the op must not sort")

    monkeypatch.setattr(moe_align, "align_tokens", no_sort)
    tri = paged_moe_triton(*case.args(), config={**SMALL, "PAIR_BLOCKS": True})
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group_m,down_group_m", [(1, 3), (3, 8), (8, 0)])
@pytest.mark.parametrize("num_tokens", [130, 1])
def test_paged_moe_grouped_program_order(num_tokens, group_m, down_group_m):
    """GROUP_M only reorders the programs: every (M block, N tile) is still computed once, groups that do not divide
    the M blocks included (3 and 5 N tiles; one token has 4 M blocks, one a pair, all of them real, where 130
    tokens end in padding blocks)."""
    case = moe_case(num_tokens, 60, 4, num_features=40, hidden_size=72, seed=3)
    ref = reference.paged_moe(*case.args())
    cfg = {**SMALL, "GROUP_M": group_m, "DOWN_GROUP_M": down_group_m}
    torch.testing.assert_close(paged_moe_triton(*case.args(), config=cfg), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_paged_attention_mixed(num_heads, num_kv_heads, head_dim):
    case = attention_case(MIXED_BATCH, num_heads, num_kv_heads, head_dim, page_tokens=4, seed=head_dim)
    ref = reference.paged_attention(*case.args())
    tri = paged_attention_triton(*case.args(), config={"BLOCK_Q": 16 // (num_heads // num_kv_heads),
                                                       "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_decode_only():
    requests = [(0, 1), (15, 1), (40, 1), (3, 1)]
    case = attention_case(requests, 8, 2, 32, page_tokens=8, seed=3)
    ref = reference.paged_attention(*case.args())
    tri = paged_attention_triton(*case.args())  # the launcher's own decode config
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


RAGGED_DECODE = [(0, 1), (15, 1), (40, 1), (3, 1), (63, 1), (23, 1)]  # 1 to 64 tokens; 8-token pages


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [2, 3, 9])  # 9: more splits than any request has pages
@pytest.mark.parametrize("min_chunk", [0, 32])  # 32: long requests use fewer, longer splits, the rest stay empty
def test_split_kv_decode(num_heads, num_kv_heads, num_splits, min_chunk):
    case = attention_case(RAGGED_DECODE, num_heads, num_kv_heads, 32, page_tokens=8, seed=num_splits)
    ref = reference.paged_attention(*case.args())
    cfg = {"BLOCK_Q": 16 // (num_heads // num_kv_heads), "BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
           "NUM_SPLITS": num_splits, "MIN_CHUNK": min_chunk}
    tri = paged_attention_triton(*case.args(), config=cfg)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_prefetch_pages(num_splits):
    """Page ids a tile ahead, in the general kernel (mixed batch) and the split kernel: the same results."""
    case = attention_case(MIXED_BATCH, 8, 2, 24, page_tokens=4, seed=num_splits)
    ref = reference.paged_attention(*case.args())
    cfg = {"BLOCK_Q": 4, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "NUM_SPLITS": num_splits,
           "PREFETCH_PAGES": True}
    tri = paged_attention_triton(*case.args(), config=cfg)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


DECODE_VARIANTS = [{}, {"HEADS_FASTEST": True}, {"PERSISTENT": True}, {"EVEN_TILES": True}, {"PREFETCH_PAGES": True},
                   {"HEADS_FASTEST": True, "PERSISTENT": True, "EVEN_TILES": True, "PREFETCH_PAGES": True}]


@pytest.mark.parametrize("flags", DECODE_VARIANTS)
@pytest.mark.parametrize("num_heads,num_kv_heads,page_tokens", [(8, 2, 8), (2, 2, 4), (12, 4, 16)])
def test_decode_attention_variants(flags, num_heads, num_kv_heads, page_tokens):
    """Every switch of the decode-only kernel against the reference: contexts of 1 to 64 tokens, full and partial
    tiles, pages poisoned past each context; 2 "SMs" so the persistent grid loops over several items a program."""
    requests = [(n - 1, 1) for n in (1, 16, 17, 41, 64, 4, 32)]
    case = attention_case(requests, num_heads, num_kv_heads, 32, page_tokens=page_tokens, seed=len(flags))
    ref = reference.paged_attention(*case.args())
    cfg = decode_config(BLOCK_N=16, num_warps=4, num_stages=1, PROGRAMS_PER_SM=1, **flags)
    tri, _ = decode_attention_triton(case.query, case.kv_view, case.page_table, case.seq_lens, case.scale, cfg,
                                     num_sms=2)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


def test_split_kv_any_batch():
    """The split kernel also computes prefill chunks and empty requests (the dispatcher never sends them)."""
    case = attention_case(MIXED_BATCH, 8, 2, 24, page_tokens=4, seed=5)
    ref = reference.paged_attention(*case.args())
    cfg = {"BLOCK_Q": 4, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "NUM_SPLITS": 3}
    tri = paged_attention_triton(*case.args(), config=cfg)
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("requests,is_split", [
    ([(300, 1), (7, 1), (100, 1)], True),  # decode-only, 6 programs of 32 (the interpreter's SMs): 4 splits
    ([(300, 0), (20, 2), (7, 1)], True),  # T == B without being decode-only: split, still right
    ([(300, 1), (7, 3), (100, 1)], False),  # mixed: the unsplit kernel
    ([(30, 1), (7, 1)], False),  # decode-only but too short to split
])
def test_dispatch_between_kernels(monkeypatch, requests, is_split):
    calls = []
    module = importlib.import_module("rimuru.ops.paged_attention")  # `rimuru.ops.paged_attention` is the function
    split = module.split_kv_attention_triton
    monkeypatch.setattr(module, "split_kv_attention_triton",
                        lambda *args: calls.append(args[-1]) or split(*args))
    case = attention_case(requests, 8, 2, 16, page_tokens=16, seed=len(calls))
    ref = reference.paged_attention(*case.args())
    tri = paged_attention_triton(*case.args())
    torch.testing.assert_close(tri, ref, rtol=1e-4, atol=1e-4)
    assert [cfg["NUM_SPLITS"] for cfg in calls] == ([4] if is_split else [])


def test_write_kv():
    case = attention_case([(10, 0), (3, 0)], 4, 2, 24, page_tokens=4, spare_pages=6)
    free = sorted(set(range(case.kv_view.shape[0])) - set(case.page_table.flatten().tolist()))
    slots = torch.tensor([free[0] * 4 + 1, -1, free[2] * 4 + 3, free[1] * 4, -1], dtype=torch.int64)
    key, value = torch.randn(2, 5, 2, 24).unbind(0)
    pool_ref = case.kv_view.clone()
    reference.write_kv(key, value, pool_ref, slots)
    write_kv_triton(key, value, case.kv_view, slots)
    torch.testing.assert_close(case.kv_view, pool_ref, equal_nan=True, rtol=0, atol=0)
    base = case.kv_view._base  # the padding between pages stays untouched
    assert torch.isnan(base[:, case.kv_view[0].numel():]).all()


ALIGN_CASES = [(1, 4, 16), (8, 128, 16), (520, 60, 32), (130, 60, 16), (700, 128, 64), (300, 5, 128), (9000, 4, 16)]


@pytest.mark.parametrize("num_pairs,num_experts,block_m", ALIGN_CASES)
def test_align_tokens_layout(num_pairs, num_experts, block_m):
    dtype = torch.int32 if num_pairs % 2 else torch.int64  # both id dtypes the router may hand over
    topk_ids = torch.randint(0, num_experts, (num_pairs, 1), dtype=dtype)
    sorted_ids, block_expert, num_padded = align_tokens_torch(topk_ids, num_experts, block_m)
    for ref, tri in zip((sorted_ids, block_expert, num_padded), align_tokens_triton(topk_ids, num_experts, block_m)):
        assert torch.equal(ref, tri)
    rows = sorted_ids[: int(num_padded)]
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    experts_of_rows = block_expert.repeat_interleave(block_m)[: int(num_padded)]
    assert (experts_of_rows[rows < num_pairs] == topk_ids.flatten()[real]).all()
    assert (block_expert[int(num_padded) // block_m:] == num_experts).all()


# decode batches of 17 to 64 pairs: the one-program sort's keys padded to a power of two
SMALL_ALIGN_CASES = [(17, 8, 32), (40, 128, 16), (64, 60, 16)]


@pytest.mark.parametrize("num_pairs,num_experts,block_m", ALIGN_CASES[:5] + SMALL_ALIGN_CASES + [(1024, 128, 16)])
@pytest.mark.parametrize("one_program", [False, True])
def test_align_tokens_either_path(num_pairs, num_experts, block_m, one_program):
    """One program sorting the pairs in registers, or count + scatter, whatever the pair count (1,024 in one sort
    included): the torch layout exactly, each run in pair order."""
    topk_ids = torch.randint(0, num_experts, (num_pairs, 1), generator=torch.Generator().manual_seed(num_pairs))
    ref = align_tokens_torch(topk_ids, num_experts, block_m)
    tri = align_tokens_triton(topk_ids, num_experts, block_m, one_program=one_program)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_pairs,num_experts,block_m", [(1, 4, 16), (130, 60, 16), (700, 128, 64),
                                                           (1000, 128, 16), (9000, 4, 16), (600, 60, 128)])
def test_atomic_sort_lays_out_the_same_runs(num_pairs, num_experts, block_m):
    """The atomic sort: the torch layout's block experts and row count exactly, and each run the same pairs (in
    whatever order the atomics gave; here, programs run one after another, the pair order). 600 pairs in 256-pair
    programs: the last one partial; 9000 over 4 experts: thousands of atomics on one counter."""
    topk_ids = torch.randint(0, num_experts, (num_pairs, 1), generator=torch.Generator().manual_seed(num_pairs))
    sorted_ids, block_expert, num_padded = align_tokens_torch(topk_ids, num_experts, block_m)
    tri = align_tokens_triton(topk_ids, num_experts, block_m, atomic=True)
    assert torch.equal(tri[1], block_expert) and torch.equal(tri[2], num_padded)
    assert torch.equal(runs_in_pair_order(tri[0], block_expert, block_m), sorted_ids)


def test_the_op_over_runs_in_another_order_gives_the_same_values():
    """What the atomic sort relies on: the op's output does not depend on the order of the pairs inside a run (each
    GEMM row is computed alone). The pairs of every run reversed, against the sorted layout: equal to the rounding.
    The interpreter's `tl.dot` is numpy's matmul, whose rounding of a row can depend on the row's place in the tile
    (3e-7 apart with numpy 2.4 on an AMD EPYC); the GPU test of the atomic sort checks the values exactly."""
    from rimuru.ops.paged_moe import moe_gemms

    case = moe_case(70, 8, 2, num_features=40, hidden_size=72, seed=4)
    sorted_ids, block_expert, num_padded = align_tokens_torch(case.topk_ids, 8, SMALL["BLOCK_M"])
    experts_of_rows = block_expert.repeat_interleave(SMALL["BLOCK_M"])[: sorted_ids.numel()]
    reversed_ids = sorted_ids.clone()
    for expert in range(8):
        run = (experts_of_rows == expert).nonzero().flatten()
        real = run[sorted_ids[run] < case.topk_ids.numel()]
        reversed_ids[real] = sorted_ids[real].flip(0)
    assert not torch.equal(reversed_ids, sorted_ids)
    args = (case.hidden, case.expert_view, case.page_table, case.topk_weights.reshape(-1))
    one = moe_gemms(*args, sorted_ids, block_expert, num_padded, 40, SMALL)
    other = moe_gemms(*args, reversed_ids, block_expert, num_padded, 40, SMALL)
    torch.testing.assert_close(one, other, rtol=1e-6, atol=1e-6)  # a pair in the wrong row would be O(1) off


def test_dependent_launches_are_plain_where_the_device_cannot_take_them():
    """`PDL` asked of a device without dependent launches (this CPU, the interpreter) launches every kernel plainly:
    the same values, and no grid-dependency instruction reaches the interpreter."""
    from rimuru.ops.dependent_launch import launch_options, pdl_supported

    assert not pdl_supported("cpu") and launch_options(False) == {}
    case = moe_case(70, 8, 2, num_features=40, hidden_size=72, seed=5)
    plain = paged_moe_triton(*case.args(), config=SMALL)
    assert torch.equal(paged_moe_triton(*case.args(), config={**SMALL, "PDL": True}), plain)


def test_l2_hints_change_no_value():
    """`L2_HINTS` (the GEMMs' eviction hints) gives the op's values exactly."""
    case = moe_case(70, 8, 2, num_features=40, hidden_size=72, seed=6)
    plain = paged_moe_triton(*case.args(), config=SMALL)
    assert torch.equal(paged_moe_triton(*case.args(), config={**SMALL, "L2_HINTS": True}), plain)


@pytest.mark.parametrize("chunk", [16, 32, 128])
@pytest.mark.parametrize("scan", [False, True])
def test_align_tokens_count_and_scatter_at_every_chunk_size(chunk, scan):
    """Count + scatter lay the rows out the same whatever pairs a program takes, with the prefix summed in each
    scatter program or scanned once; the default shrinks the chunk for small batches so that about COUNT_PROGRAMS
    programs run (512 pairs: 32 a program), and for many experts so that a one-hot tile stays TILE_ENTRIES."""
    topk_ids = torch.randint(0, 60, (130, 4), generator=torch.Generator().manual_seed(chunk))
    ref = align_tokens_torch(topk_ids, 60, 16)
    for a, b in zip(ref, align_tokens_triton(topk_ids, 60, 16, one_program=False, chunk=chunk, scan=scan)):
        assert torch.equal(a, b)
    assert [count_chunk(n, 60) for n in (64, 512, 1000, 4096, 32768)] == [16, 32, 64, 128, 128]
    assert [count_chunk(n, 128) for n in (64, 512, 1000, 4096, 32768)] == [16, 32, 64, 64, 64]


@pytest.mark.parametrize("num_pairs,num_experts,block_m", [(9000, 4, 16), (2000, 60, 64), (1000, 128, 16),
                                                           (20000, 128, 128), (300, 5, 16), (16384, 60, 128),
                                                           (6000, 160, 64)])  # 160: 32-pair tiles, a 2-pass scan
@pytest.mark.parametrize("scan", [None, False, True])  # None: the path the op takes (`scans_counts`)
@pytest.mark.parametrize("max_programs", [MAX_SORT_PROGRAMS, 5])
def test_align_tokens_with_and_without_the_scan(num_pairs, num_experts, block_m, scan, max_programs):
    """Many tiles (313 of 64 pairs for 20,000 with 128 experts: 105 programs of 3 tiles): the scanned starts give
    the torch layout, as do the starts each scatter program sums for itself; so do 5 programs of many tiles."""
    topk_ids = torch.randint(0, num_experts, (num_pairs // 4, 4), generator=torch.Generator().manual_seed(num_pairs))
    ref = align_tokens_torch(topk_ids, num_experts, block_m)
    tri = align_tokens_triton(topk_ids, num_experts, block_m, one_program=False, scan=scan, max_programs=max_programs)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    assert sort_chunks(32768, 64) == (256, 128) and sort_chunks(20000, 64) == (192, 105)
    # the op scans Qwen3's table at 1,024 tokens and up (128 programs x 128 experts), not Qwen1.5's (x 64)
    assert scans_counts(128, 128) and not scans_counts(128, 64) and not scans_counts(32, 64)


@pytest.mark.parametrize("shape", [(1, 72), (3, 24), (130, 2048), (5, 4, 17)])
def test_rms_norm(shape):
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1])
    ref = reference.rms_norm(x, weight, 1e-6)
    tri = rms_norm_triton(x, weight, 1e-6)
    assert tri.shape == ref.shape
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 72), (3, 24), (130, 2048)])
def test_add_rms_norm(shape):
    """x a view with a row stride wider than its rows, as a projection's output slice may be."""
    x = (torch.randn(shape[0], shape[1] + 7) * 3)[:, : shape[1]]
    residual, weight = torch.randn(*shape), torch.randn(shape[-1])
    (ref, ref_sum), (tri, tri_sum) = reference.add_rms_norm(x, residual, weight, 1e-6), add_rms_norm_triton(
        x, residual, weight, 1e-6)  # fmt: skip
    torch.testing.assert_close(tri_sum, ref_sum, rtol=0, atol=0)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_features", [(1, 8), (5, 1408), (3, 2500)])
def test_silu_and_mul(num_tokens, num_features):
    x = torch.randn(num_tokens, 2 * num_features) * 4
    torch.testing.assert_close(silu_and_mul_triton(x), reference.silu_and_mul(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 72), (4, 2048), (9, 1500)])
def test_sigmoid_gated_add(num_tokens, hidden_size):
    """The gate logit a [T, 1] column of a wider projection output (its row stride), as a stacked gate leaves it."""
    base, x = torch.randn(num_tokens, hidden_size), torch.randn(num_tokens, hidden_size)
    gate_logits = (torch.randn(num_tokens, 3) * 4)[:, 1:2]
    tri = sigmoid_gated_add_triton(base, gate_logits, x)
    torch.testing.assert_close(tri, reference.sigmoid_gated_add(base, gate_logits, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_q_heads,num_k_heads,head_dim,norms", [
    (1, 4, 4, 16, True), (5, 8, 2, 32, True), (6, 8, 2, 32, False), (17, 3, 1, 8, True)])  # fmt: skip
def test_rope_write_kv(num_tokens, num_q_heads, num_k_heads, head_dim, norms):
    """The fused projection's rows with a token stride wider than the heads (a view), slots with a padding row:
    q equal to the reference chain's, and the pool written where (and only where) the reference writes it."""
    gen = torch.Generator().manual_seed(num_tokens)
    width = (num_q_heads + 2 * num_k_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 5, generator=gen)[:, :width]
    weights = (torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)) if norms else (None, None)
    angles = torch.randn(num_tokens, head_dim // 2, generator=gen).repeat(1, 2)
    kv_view = torch.full((num_tokens + 3, 2, 4, num_k_heads, head_dim), float("nan"))
    slots = torch.randperm(kv_view.shape[0] * 4, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1
    args = (*weights, 1e-6, angles.cos(), angles.sin())
    pool_ref = kv_view.clone()
    ref = reference.rope_write_kv(qkv, *args, pool_ref, slots, num_q_heads, num_k_heads)
    tri = rope_write_kv_triton(qkv, *args, kv_view, slots, num_q_heads, num_k_heads)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_view, pool_ref, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", [(1, 60, 4, False), (17, 128, 8, True),
                                                                      (40, 5, 1, True), (3, 512, 10, True)])
def test_topk_softmax(num_tokens, num_experts, top_k, renormalize):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2
    ids, weights = topk_softmax_triton(logits, top_k, renormalize)
    ref_ids, ref_weights = reference.topk_softmax(logits, top_k, renormalize)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_topk_softmax_routes_padding_rows_as_row_0():
    """A graph's padding rows (garbage logits, here NaN) take row 0's experts and weights; the real rows keep theirs,
    as the torch form's `where` over the ids has them."""
    logits = torch.randn(20, 128, generator=torch.Generator().manual_seed(1))
    padding = torch.zeros(20, dtype=torch.bool)
    padding[13:] = True
    logits[13:] = float("nan")
    ids, weights = topk_softmax_triton(logits, 8, True, padding)
    ref_ids, ref_weights = reference.topk_softmax(logits[:13], 8, True)
    assert torch.equal(ids[:13], ref_ids) and torch.equal(ids[13:], ref_ids[:1].expand(7, 8))
    torch.testing.assert_close(weights[13:], ref_weights[:1].expand(7, 8), rtol=1e-5, atol=1e-6)
    assert torch.equal(reference.topk_softmax(logits, 8, True, padding)[0], ids)


def test_topk_softmax_keeps_the_ids_of_a_nan_row_in_range():
    """NaN logits (a state page's garbage upstream) must not become expert id E, which the MoE kernels would read
    past their tables with: the row's ids stay below E, the other rows are untouched."""
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    ids, weights = topk_softmax_triton(logits, 4, True)
    ref_ids, ref_weights = reference.topk_softmax(logits[[0, 2]], 4, True)
    assert ((ids >= 0) & (ids < 60)).all()
    assert torch.equal(ids[[0, 2]], ref_ids)
    torch.testing.assert_close(weights[[0, 2]], ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens,top_k,hidden_size,block_d", [(1, 1, 72, 1024), (3, 8, 2048, 1024),
                                                                   (5, 3, 1000, 256), (130, 4, 72, 32), (7, 6, 33, 16)])
def test_topk_sum(num_tokens, top_k, hidden_size, block_d):
    """Rows of a padded buffer (NaN between tokens' rows and past D): only the K rows of each token are read."""
    base = torch.full((num_tokens, top_k + 1, hidden_size + 5), float("nan"))
    pairs = base[:, :top_k, :hidden_size]  # [T, K, D], strides of the padded buffer
    pairs.copy_(torch.randn(num_tokens, top_k, hidden_size, generator=torch.Generator().manual_seed(top_k)))
    ref = pairs.sum(1)
    tri = topk_sum_triton(pairs, {"BLOCK_D": block_d, "num_warps": 4})
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def pool_pages(num_pages: int, page_shape: tuple[int, ...], padding: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages [P, *page_shape] as the pool views them: `padding` NaN elements after each page, the rows under them)."""
    rows = torch.full((num_pages, math.prod(page_shape) + padding), float("nan"))
    pages = rows[:, : math.prod(page_shape)].view(num_pages, *page_shape)
    pages.copy_(torch.randn(pages.shape, generator=gen))
    return pages, rows


@pytest.mark.parametrize("num_requests,hk,hv,dk,dv,block_v", [(3, 2, 4, 8, 12, 8), (5, 1, 2, 16, 16, 32),
                                                               (2, 4, 4, 32, 20, 16)])  # fmt: skip
def test_gated_delta_step(num_requests, hk, hv, dk, dv, block_v):
    """States at scattered pages that sit further apart than a state (the pool pads them), one row padding (state id
    -1): the states change in place, and only theirs."""
    gen = torch.Generator().manual_seed(num_requests * dk)
    q, k = torch.randn(2, num_requests, hk, dk, generator=gen).unbind(0)
    v = torch.randn(num_requests, hv, dv, generator=gen)
    g = -torch.rand(num_requests, hv, generator=gen)
    beta = torch.rand(num_requests, hv, generator=gen)
    tri_pages, rows = pool_pages(2 * num_requests + 1, (hv, dk, dv), dv + 3, gen)
    ids = torch.randperm(2 * num_requests + 1, generator=gen)[:num_requests]
    ids[1] = -1
    ref_pages = tri_pages.clone()
    ref = reference.gated_delta_step(q, k, v, g, beta, ref_pages, ids)
    tri = gated_delta_step_triton(q, k, v, g, beta, tri_pages, ids, block_v=block_v)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri_pages, ref_pages, rtol=1e-5, atol=1e-5)
    assert rows[:, tri_pages[0].numel() :].isnan().all()


@pytest.mark.parametrize("num_requests,channels,width,block_c,bias", [(3, 40, 4, 16, True), (2, 7, 2, 8, False),
                                                                       (4, 130, 3, 64, True)])  # fmt: skip
def test_causal_conv1d_step(num_requests, channels, width, block_c, bias):
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(num_requests, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    tri_pages, rows = pool_pages(2 * num_requests + 1, (channels, width - 1), channels // 2, gen)
    ids = torch.randperm(2 * num_requests + 1, generator=gen)[:num_requests]
    ids[0] = -1
    ref_pages = tri_pages.clone()
    ref = reference.causal_conv1d_step(x, ref_pages, ids, weight, b)
    tri = causal_conv1d_step_triton(x, tri_pages, ids, weight, b, block_c=block_c)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri_pages, ref_pages, rtol=0, atol=0)
    assert rows[:, tri_pages[0].numel() :].isnan().all()
