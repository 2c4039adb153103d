"""Split-KV (flash-decoding) paged attention: decode batches spread each request's K/V over several programs.

Owns two Triton kernels, the split-count heuristic and their launcher; `rimuru.ops.paged_attention` decides when
to call it (decode-only batches) and the reference is `rimuru.ops.reference.paged_attention`. Does not write the
cache.

A decode batch of B requests gives the unsplit kernel only B * Hk programs (256 for 64 Qwen3-30B-A3B requests: about
two a streaming multiprocessor on an H200), too few to keep HBM busy. Here program (b, kv head, split s) runs the
online softmax over one slice of request b's K/V for all GROUP query heads of that kv head (each K/V page is still
read once per kv head) and writes a partial (max, sum, acc) per query row; `_combine_kernel` merges the splits.

    request b, NUM_SPLITS = 4, chunk = round_up(cdiv(seq_len_b, 4), BLOCK_N)   (computed on the device)
    tokens  |---- split 0 ----|---- split 1 ----|---- split 2 ----|-- split 3 --|   split s: [s * chunk, ...)
    a short request leaves its last splits empty: they store (max -inf, sum 0) and no acc, and exit

Partials (fp32; row = (token, query head)), merged in log2 units:
    part_max, part_sum  [T, Hq, NUM_SPLITS]      part_acc  [T, Hq, NUM_SPLITS, Dh]
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s

The number of splits comes from shapes only (no host sync): about one program an SM, at most one split per
MIN_SPLIT_TOKENS of the longest possible context (page table width * page tokens); the chunk comes from the real
length on the device, so a short request in a wide table spreads over as many splits as it has tiles. Every program loops over its
request's query blocks, so any batch is computed correctly, but prefill chunks would redo the split bookkeeping for
nothing: the dispatcher sends only decode batches here.

Faster than the unsplit kernel below about one and a half programs an SM and slower from two up, so not used there
(the timings are in docs/benchmarks/kernels.md).
"""

import functools

import torch
import triton
import triton.language as tl

from rimuru.ops.attention_tiles import attend_pages

LOG2_E = 1.4426950408889634
# Split while the unsplit kernel has under 1.5 programs an SM (one program streams one request's K/V, too little for an
# SM's share of HBM), into about one program an SM: fewer, longer chunks beat four an SM (kernels.md, small batches).
MAX_UNSPLIT_PROGRAMS_PER_SM = 1.5
MIN_SPLIT_TOKENS = 64  # no more splits than this many tokens of the longest possible context each: one bf16 K/V tile
MAX_SPLITS = 64
INTERPRETER_SMS = 32  # CPU (Triton interpreter): a small GPU's worth, so test batches of a few requests split


@triton.jit
def _split_kv_kernel(
    p_query, p_kv, p_page_table, p_seq_lens, p_query_start_loc, p_part_max, p_part_sum, p_part_acc,
    num_heads, num_splits, head_dim, scale_log2, min_chunk,
    stride_qt, stride_qh,
    stride_kv_page, stride_kv_kind, stride_kv_token, stride_kv_head, stride_kv_dim, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_TOKENS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
):
    i_b, i_kh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(p_query_start_loc + i_b)
    num_queries = tl.load(p_query_start_loc + i_b + 1) - q_start
    seq_len = tl.load(p_seq_lens + i_b)
    context = seq_len - num_queries
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_chunk)
    n_lo = i_s * chunk

    o_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim
    o_h = i_kh * GROUP + o_m % GROUP_PAD  # [BM] query head
    p_kv_head = p_kv + i_kh * stride_kv_head + o_d[None, :] * stride_kv_dim
    for q_first in range(0, num_queries, BLOCK_Q):  # one iteration for a decode request
        o_q = q_first + o_m // GROUP_PAD  # [BM] query index within the request
        m_m = (o_q < num_queries) & (o_m % GROUP_PAD < GROUP)
        p_q = p_query + (q_start + o_q)[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BM, Dh]
        q_pos = context + o_q  # [BM]
        n_hi = tl.minimum(tl.minimum(seq_len, context + q_first + BLOCK_Q), n_lo + chunk)  # causal and split end

        b_max, b_sum, b_acc = attend_pages(
            b_q, q_pos, n_lo, n_hi, p_page_table + i_b * stride_table, p_kv_head, m_d, scale_log2,
            stride_kv_page, stride_kv_token, stride_kv_kind, BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD, PAGE_TOKENS, BLOCK_N,
            PREFETCH_PAGES,
        )

        o_row = ((q_start + o_q) * num_heads + o_h) * num_splits + i_s  # [BM] partial index
        tl.store(p_part_max + o_row, b_max, mask=m_m)
        tl.store(p_part_sum + o_row, b_sum, mask=m_m)
        p_a = p_part_acc + o_row[:, None].to(tl.int64) * head_dim + o_d[None, :]
        m_a = m_m & (n_lo + 0 * o_m < n_hi)  # [BM] an empty split stores no acc
        tl.store(p_a, b_acc, mask=m_a[:, None] & m_d[None, :])


@triton.jit
def _combine_kernel(
    p_part_max, p_part_sum, p_part_acc, p_out, num_splits, head_dim, stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_row = (i_t * tl.num_programs(1) + i_h).to(tl.int64) * num_splits  # the grid's axis 1 is Hq
    o_s = tl.arange(0, SPLITS_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    b_max = tl.load(p_part_max + o_row + o_s, mask=o_s < num_splits, other=float("-inf"))  # [S]
    b_sum = tl.load(p_part_sum + o_row + o_s, mask=o_s < num_splits, other=0.0)
    # NOTE: split 0 starts at token 0, which every query sees, so the max is finite and weights are 0 or positive.
    b_weight = tl.exp2(b_max - tl.max(b_max, 0))  # [S]
    m_acc = (b_max > float("-inf"))[:, None] & (o_d < head_dim)[None, :]  # empty splits stored no acc
    b_acc = tl.load(p_part_acc + (o_row + o_s)[:, None] * head_dim + o_d[None, :], mask=m_acc, other=0.0)
    b_out = tl.sum(b_acc * b_weight[:, None], 0) / tl.sum(b_sum * b_weight, 0)  # [Dh]
    tl.store(p_out + i_t * stride_ot + i_h * stride_oh + o_d, b_out.to(p_out.dtype.element_ty), mask=o_d < head_dim)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_requests: int, num_kv_heads: int, max_kv_tokens: int, sms: int) -> int:
    """Splits a request's K/V: 1 when B * Hk programs already give each of `sms` 1.5, else the power of two (at
    least 2) that brings the programs closest to one an SM from below, capped by the longest context."""
    programs = num_requests * num_kv_heads
    if programs >= MAX_UNSPLIT_PROGRAMS_PER_SM * sms:
        return 1
    wanted = max(2, 1 << max(0, (sms // max(1, programs)).bit_length() - 1))
    return max(1, min(wanted, triton.cdiv(max_kv_tokens, MIN_SPLIT_TOKENS), MAX_SPLITS))


def split_kv_attention_triton(
    query: torch.Tensor,  # [T, Hq, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], any strides
    page_table: torch.Tensor,  # [B, max pages] int32
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    config: dict,  # BLOCK_Q, BLOCK_N, num_warps, num_stages, NUM_SPLITS
) -> torch.Tensor:  # [T, Hq, Dh]
    num_tokens, num_heads, head_dim = query.shape
    _, _, page_tokens, num_kv_heads, _ = kv_view.shape
    num_requests, num_splits = seq_lens.shape[0], config["NUM_SPLITS"]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_requests == 0:
        return out
    assert query.stride(2) == 1, "query rows must be contiguous in the head dim"
    part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    group, head_dim_pad = num_heads // num_kv_heads, max(16, triton.next_power_of_2(head_dim))
    _split_kv_kernel[(num_requests, num_kv_heads, num_splits)](
        query, kv_view, page_table, seq_lens, query_start_loc, part_max, part_sum, part_acc,
        num_heads, num_splits, head_dim, scale * LOG2_E, config.get("MIN_CHUNK", 0), query.stride(0), query.stride(1),
        *kv_view.stride(),
        page_table.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=config["BLOCK_Q"], BLOCK_N=config["BLOCK_N"],
        PAGE_TOKENS=page_tokens, HEAD_DIM_PAD=head_dim_pad, PREFETCH_PAGES=config.get("PREFETCH_PAGES", False),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    _combine_kernel[(num_tokens, num_heads)](
        part_max, part_sum, part_acc, out, num_splits, head_dim, out.stride(0), out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM_PAD=head_dim_pad, num_warps=4,
    )
    return out
