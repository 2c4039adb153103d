"""The online-softmax loop over paged K/V tiles that both attention kernels run (`paged_attention`, split-KV).

One call walks tokens [n_lo, n_hi) of one request and one KV head in BLOCK_N tiles, reading each token's page from
the request's page table row, and returns the running (max, sum, acc) in log2 units for the ROWS query rows. With
PREFETCH_PAGES a tile's page ids are loaded one tile ahead: the K/V addresses then depend on no load of the same
iteration, and Triton's pipeliner keeps num_stages - 1 K/V tiles in flight (without it, one; seen in the TTGIR for
sm_90):

    K/V token n  ->  p_kv_head + page_table_row[n // PAGE_TOKENS] * stride_kv_page + (n % PAGE_TOKENS) * stride_kv_token
                     (+ stride_kv_kind for V)
"""

import triton
import triton.language as tl

from rimuru.ops.exact_dot import dot


@triton.jit
def tile_pages(p_table_row, n_start, n_hi, PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of tokens [n_start, n_start + BLOCK_N), 0 past n_hi."""
    o_n = n_start + tl.arange(0, BLOCK_N)
    return tl.load(p_table_row + o_n // PAGE_TOKENS, mask=o_n < n_hi, other=0).to(tl.int64)  # [BN]


@triton.jit
def attend_pages(
    b_q, q_pos, n_lo, n_hi, p_table_row, p_kv_head, m_d, scale_log2,
    stride_kv_page, stride_kv_token, stride_kv_kind,
    ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
):
    b_max = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros((ROWS,), dtype=tl.float32)
    b_acc = tl.zeros((ROWS, HEAD_DIM_PAD), dtype=tl.float32)
    if PREFETCH_PAGES:
        b_page = tile_pages(p_table_row, n_lo, n_hi, PAGE_TOKENS, BLOCK_N)
    for n_start in range(n_lo, n_hi, BLOCK_N):
        o_n = n_start + tl.arange(0, BLOCK_N)
        m_n = o_n < n_hi
        if PREFETCH_PAGES:
            b_next = tile_pages(p_table_row, n_start + BLOCK_N, n_hi, PAGE_TOKENS, BLOCK_N)
        else:
            b_page = tile_pages(p_table_row, n_start, n_hi, PAGE_TOKENS, BLOCK_N)
        o_kv = b_page[:, None] * stride_kv_page + (o_n % PAGE_TOKENS)[:, None] * stride_kv_token  # [BN, 1]
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_kv_head + o_kv, mask=m_kv, other=0.0)  # [BN, Dh]
        b_s = dot(b_q, tl.trans(b_k)) * scale_log2  # [ROWS, BN], log2 units
        b_s = tl.where(m_n[None, :] & (o_n[None, :] <= q_pos[:, None]), b_s, float("-inf"))
        b_new_max = tl.maximum(b_max, tl.max(b_s, 1))
        # NOTE: a row may see no token of this tile range yet; shifting by 0 keeps its -inf - -inf from NaN.
        b_shift = tl.where(b_new_max == float("-inf"), 0.0, b_new_max)
        b_p = tl.exp2(b_s - b_shift[:, None])
        b_alpha = tl.exp2(b_max - b_shift)
        b_v = tl.load(p_kv_head + o_kv + stride_kv_kind, mask=m_kv, other=0.0)  # [BN, Dh]
        b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v)
        b_sum = b_sum * b_alpha + tl.sum(b_p, 1)
        b_max = b_new_max
        if PREFETCH_PAGES:
            b_page = b_next
    return b_max, b_sum, b_acc

