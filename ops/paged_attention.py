"""`rimuru::paged_attention`: causal GQA attention of a batch mixing prefill chunks and decode tokens over K/V pages.

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.paged_attention`. Does not write
the cache (`rimuru.ops.write_kv`).

One program takes BLOCK_Q consecutive queries of one request and all GROUP query heads sharing one KV head, so
each K/V tile is loaded once for BLOCK_M = BLOCK_Q * GROUP rows. Programs are numbered without a host sync:
request b owns program ids from `query_start_loc[b] // BLOCK_Q + b` on, so T // BLOCK_Q + B programs always
suffice; a program finds its request by binary search and exits when it has no queries.

    rows of one program:  (q0,h0) (q0,h1) .. (q0,hG-1) (q1,h0) ..       query q sits at position ctx + q
    K/V token n        ->  kv_view[page_table[b, n // S], 0 or 1, n % S, kv_head, :]   (through the view's strides)

Decode-only batches (T == B) whose shapes call for more than one split go to the split-KV kernel
(`rimuru.ops.split_kv_attention`), the other decode-only batches to the decode kernel (`rimuru.ops.decode_attention`:
no request search, no causal mask); everything else runs here.

Decode reaches a larger share of the copy bandwidth in the decode kernel than here (docs/benchmarks/kernels.md).
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.attention_tiles import attend_pages
from rimuru.ops.decode_attention import decode_attention_triton, decode_config
from rimuru.ops.split_kv_attention import LOG2_E, decode_splits, num_sms, split_kv_attention_triton


@triton.jit
def _find_request(p_query_start_loc, num_requests, i_q, BLOCK_Q: tl.constexpr):
    lo, hi = 0, num_requests
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_block = tl.load(p_query_start_loc + mid) // BLOCK_Q + mid
        if first_block <= i_q:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _paged_attention_kernel(
    p_query, p_kv, p_page_table, p_seq_lens, p_query_start_loc, p_out,
    num_requests, head_dim, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv_page, stride_kv_kind, stride_kv_token, stride_kv_head, stride_kv_dim, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_TOKENS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
):
    i_q, i_kh = tl.program_id(0), tl.program_id(1)
    i_b = _find_request(p_query_start_loc, num_requests, i_q, BLOCK_Q)
    q_start = tl.load(p_query_start_loc + i_b)
    num_queries = tl.load(p_query_start_loc + i_b + 1) - q_start
    q_first = (i_q - (q_start // BLOCK_Q + i_b)) * BLOCK_Q  # first query of this program, within the request
    if q_first >= num_queries:
        return
    seq_len = tl.load(p_seq_lens + i_b)
    context = seq_len - num_queries

    o_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    o_q = q_first + o_m // GROUP_PAD  # [BM] query index within the request
    o_h = i_kh * GROUP + o_m % GROUP_PAD  # [BM] query head
    m_m = (o_q < num_queries) & (o_m % GROUP_PAD < GROUP)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < head_dim
    p_q = p_query + (q_start + o_q)[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BM, Dh]
    q_pos = context + o_q  # [BM]

    kv_end = tl.minimum(seq_len, context + q_first + BLOCK_Q)  # causal: no later token is needed
    p_kv_head = p_kv + i_kh * stride_kv_head + o_d[None, :] * stride_kv_dim
    b_max, b_sum, b_acc = attend_pages(
        b_q, q_pos, 0, kv_end, p_page_table + i_b * stride_table, p_kv_head, m_d, scale_log2,
        stride_kv_page, stride_kv_token, stride_kv_kind, BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD, PAGE_TOKENS, BLOCK_N,
        PREFETCH_PAGES,
    )
    b_out = b_acc / b_sum[:, None]
    p_o = p_out + (q_start + o_q)[:, None] * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_out.to(p_out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def attention_config(num_tokens: int, num_requests: int, group: int, num_splits: int = 1,
                     element_size: int = 2) -> dict:  # fmt: skip
    """Decode-only batches (T == B) take one query a program and long K/V tiles (best of a sweep on an H200; half
    as long in fp32, whose 128-token K and V tiles of 128 dims overflow shared memory), split `num_splits` ways or
    else run in the decode kernel with all its flags on (`DECODE`, the fastest of `tools/kernels/decode_attention.py`);
    prefill chunks take enough rows to fill a tile and are never split."""
    group_pad = triton.next_power_of_2(group)
    if num_tokens <= num_requests:
        block_n = 128 if element_size <= 2 else 64
        if num_splits > 1:  # short chunks: 64-token tiles, four warps, three stages (kernels.md, small batches)
            return {"BLOCK_Q": max(1, 16 // group_pad), "BLOCK_N": block_n // 2, "num_warps": 4, "num_stages": 3,
                    "NUM_SPLITS": num_splits, "PREFETCH_PAGES": True}
        decode = decode_config(BLOCK_N=block_n, HEADS_FASTEST=True, EVEN_TILES=True, PREFETCH_PAGES=True)
        return {"BLOCK_Q": max(1, 16 // group_pad), "BLOCK_N": block_n, "num_warps": 8, "num_stages": 2,
                "NUM_SPLITS": 1, "DECODE": decode}
    return {"BLOCK_Q": max(1, 64 // group_pad), "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "NUM_SPLITS": 1}


def default_config(query, kv_view, page_table, num_requests) -> dict:
    """The launcher's config from shapes alone. NOTE: T == B means decode-only because every scheduled request
    brings at least one token; the split kernel is correct for any batch, so a caller breaking that only loses speed.
    """
    num_tokens, num_heads, _ = query.shape
    _, _, page_tokens, num_kv_heads, _ = kv_view.shape
    num_splits = 1
    if num_tokens == num_requests:
        max_kv_tokens = page_table.shape[1] * page_tokens
        num_splits = decode_splits(num_requests, num_kv_heads, max_kv_tokens, num_sms(query.device))
    return attention_config(num_tokens, num_requests, num_heads // num_kv_heads, num_splits, query.element_size())


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], any strides
    page_table: torch.Tensor,  # [B, max pages] int32
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    config: dict | None = None,
) -> torch.Tensor:  # [T, Hq, Dh]
    num_tokens, num_heads, head_dim = query.shape
    _, _, page_tokens, num_kv_heads, _ = kv_view.shape
    num_requests = seq_lens.shape[0]
    cfg = config or default_config(query, kv_view, page_table, num_requests)
    if cfg.get("NUM_SPLITS", 1) > 1:
        return split_kv_attention_triton(query, kv_view, page_table, seq_lens, query_start_loc, scale, cfg)
    if cfg.get("DECODE") and _decode_kernel_takes(query, kv_view, num_requests):
        return decode_attention_triton(query, kv_view, page_table, seq_lens, scale, cfg["DECODE"],
                                       num_sms(query.device))[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_requests == 0:
        return out
    assert query.stride(2) == 1, "query rows must be contiguous in the head dim"
    group = num_heads // num_kv_heads
    grid = (num_tokens // cfg["BLOCK_Q"] + num_requests, num_kv_heads)
    _paged_attention_kernel[grid](
        query, kv_view, page_table, seq_lens, query_start_loc, out,
        num_requests, head_dim, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *kv_view.stride(), page_table.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=cfg["BLOCK_Q"], BLOCK_N=cfg["BLOCK_N"],
        PAGE_TOKENS=page_tokens, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PREFETCH_PAGES=cfg.get("PREFETCH_PAGES", False), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _decode_kernel_takes(query, kv_view, num_requests) -> bool:
    """One query a request, head dims contiguous and a power of two from 16: the decode kernel's preconditions."""
    head_dim = query.shape[2]
    return (query.shape[0] == num_requests > 0 and query.stride(2) == 1 and kv_view.stride(4) == 1
            and head_dim >= 16 and head_dim == triton.next_power_of_2(head_dim))


@torch.library.custom_op("rimuru::paged_attention", mutates_args=(), device_types="cpu")
def paged_attention(
    query: torch.Tensor,
    kv_view: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return reference.paged_attention(query, kv_view, page_table, seq_lens, query_start_loc, scale)


@paged_attention.register_kernel("cuda")
def _paged_attention_cuda(query, kv_view, page_table, seq_lens, query_start_loc, scale):
    return paged_attention_triton(query, kv_view, page_table, seq_lens, query_start_loc, scale)


@paged_attention.register_fake
def _paged_attention_fake(query, kv_view, page_table, seq_lens, query_start_loc, scale):
    return torch.empty_like(query)
