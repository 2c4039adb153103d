"""Decode-only paged attention (one query a request, T == B) with its variants behind constexpr flags.

Owns one Triton kernel and its launcher, `rimuru.ops.paged_attention`'s path for unsplit decode batches;
`tools/kernels/decode_attention.py` times the variants against the general kernel, and the winner is the decode
config there (docs/benchmarks/kernels.md: faster than the general kernel on the H200 with all flags but
PERSISTENT). The reference is `rimuru.ops.reference.paged_attention`.

A work item is (request b, kv head): the GROUP query heads of that kv head against all of b's K/V, read once.
Unlike the general kernel there is no binary search for the request and no causal mask (a decode query sees its
whole context). Work items map to programs as

    HEADS_FASTEST   item w -> (b = w // Hk, kv head = w % Hk): the Hk programs of a request run side by side and
                    read the same pages (each token row holds all Hk heads: [S, Hk, Dh] per page and K or V)
    otherwise       item w -> (b = w % B, kv head = w // B), the general kernel's order
    PERSISTENT      NUM_PROGRAMS programs loop over the items w = pid, pid + NUM_PROGRAMS, ..

and the K/V loop over BLOCK_N-token tiles has two switches:

    EVEN_TILES      full tiles without masks, then one masked tail tile (else every tile masked)
    PREFETCH_PAGES  tile i + 1's page ids are loaded during tile i, so the K/V addresses never wait on the table
"""

import torch
import triton
import triton.language as tl

from rimuru.ops.attention_tiles import tile_pages
from rimuru.ops.exact_dot import dot
from rimuru.ops.split_kv_attention import LOG2_E

DECODE_FLAGS = ("HEADS_FASTEST", "PERSISTENT", "EVEN_TILES", "PREFETCH_PAGES")


@triton.jit
def _attend_tile(b_q, b_max, b_sum, b_acc, b_page, n_start, n_hi, p_kv_head, stride_kv_page, stride_kv_token,
                 stride_kv_kind, scale_log2, BLOCK_N: tl.constexpr, PAGE_TOKENS: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over tokens [n_start, n_start + BLOCK_N), masked past n_hi when MASKED."""
    o_n = n_start + tl.arange(0, BLOCK_N)
    o_kv = b_page[:, None] * stride_kv_page + (o_n % PAGE_TOKENS)[:, None] * stride_kv_token  # [BN, 1]
    if MASKED:
        m_n = o_n < n_hi
        b_k = tl.load(p_kv_head + o_kv, mask=m_n[:, None], other=0.0)  # [BN, Dh]
        b_v = tl.load(p_kv_head + o_kv + stride_kv_kind, mask=m_n[:, None], other=0.0)
        b_s = tl.where(m_n[None, :], dot(b_q, tl.trans(b_k)) * scale_log2, float("-inf"))  # [ROWS, BN]
    else:
        b_k = tl.load(p_kv_head + o_kv)
        b_v = tl.load(p_kv_head + o_kv + stride_kv_kind)
        b_s = dot(b_q, tl.trans(b_k)) * scale_log2
    # NOTE: every tile holds at least one token and every row sees it, so the new max is finite
    b_new_max = tl.maximum(b_max, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_new_max[:, None])
    b_alpha = tl.exp2(b_max - b_new_max)
    b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v)
    return b_new_max, b_sum * b_alpha + tl.sum(b_p, 1), b_acc


@triton.jit
def _attend_request(b_q, seq_len, p_table_row, p_kv_head, scale_log2, stride_kv_page, stride_kv_token,
                    stride_kv_kind, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_TOKENS: tl.constexpr,
                    BLOCK_N: tl.constexpr, EVEN_TILES: tl.constexpr, PREFETCH_PAGES: tl.constexpr):
    """(max, sum, acc) of the online softmax over tokens [0, seq_len), log2 units: the full tiles unmasked (with
    EVEN_TILES), then the rest masked."""
    b_max = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros((ROWS,), dtype=tl.float32)
    b_acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    full_end = (seq_len // BLOCK_N) * BLOCK_N if EVEN_TILES else 0
    b_page = tile_pages(p_table_row, 0, seq_len, PAGE_TOKENS, BLOCK_N)
    b_max, b_sum, b_acc, b_page = _attend_span(
        b_q, b_max, b_sum, b_acc, b_page, 0, full_end, seq_len, p_table_row, p_kv_head, scale_log2,
        stride_kv_page, stride_kv_token, stride_kv_kind, PAGE_TOKENS, BLOCK_N, PREFETCH_PAGES, False)
    b_max, b_sum, b_acc, b_page = _attend_span(
        b_q, b_max, b_sum, b_acc, b_page, full_end, seq_len, seq_len, p_table_row, p_kv_head, scale_log2,
        stride_kv_page, stride_kv_token, stride_kv_kind, PAGE_TOKENS, BLOCK_N, PREFETCH_PAGES, True)
    return b_max, b_sum, b_acc


@triton.jit
def _attend_span(b_q, b_max, b_sum, b_acc, b_page, n_from, n_to, seq_len, p_table_row, p_kv_head, scale_log2,
                 stride_kv_page, stride_kv_token, stride_kv_kind, PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                 PREFETCH_PAGES: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax over the tiles from n_from to n_to; `b_page` holds tile n_from's page ids (PREFETCH_PAGES
    loads each next tile's during the current one) and comes back holding tile n_to's."""
    for n_start in range(n_from, n_to, BLOCK_N):
        if PREFETCH_PAGES:
            b_next = tile_pages(p_table_row, n_start + BLOCK_N, seq_len, PAGE_TOKENS, BLOCK_N)
        else:
            b_page = tile_pages(p_table_row, n_start, seq_len, PAGE_TOKENS, BLOCK_N)
        b_max, b_sum, b_acc = _attend_tile(b_q, b_max, b_sum, b_acc, b_page, n_start, seq_len, p_kv_head,
                                           stride_kv_page, stride_kv_token, stride_kv_kind, scale_log2, BLOCK_N,
                                           PAGE_TOKENS, MASKED)
        if PREFETCH_PAGES:
            b_page = b_next
    return b_max, b_sum, b_acc, b_page


@triton.jit
def _decode_kernel(
    p_query, p_kv, p_page_table, p_seq_lens, p_out,
    num_requests, num_kv_heads, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv_page, stride_kv_kind, stride_kv_token, stride_kv_head, stride_table,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS_FASTEST: tl.constexpr, PERSISTENT: tl.constexpr, EVEN_TILES: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
):
    o_m = tl.arange(0, ROWS)  # query head within the group; rows from GROUP on are padding for tl.dot
    m_m = o_m < GROUP
    o_d = tl.arange(0, HEAD_DIM)
    num_items = num_requests * num_kv_heads
    step = tl.num_programs(0) if PERSISTENT else num_items
    for w in range(tl.program_id(0), num_items, step):  # one iteration unless PERSISTENT
        if HEADS_FASTEST:
            i_b, i_kh = w // num_kv_heads, w % num_kv_heads
        else:
            i_b, i_kh = w % num_requests, w // num_requests
        o_h = i_kh * GROUP + o_m  # [ROWS] query heads
        b_q = tl.load(p_query + i_b * stride_qt + o_h[:, None] * stride_qh + o_d[None, :], mask=m_m[:, None],
                      other=0.0)  # [ROWS, Dh]
        p_kv_head = p_kv + i_kh * stride_kv_head + o_d[None, :]
        _, b_sum, b_acc = _attend_request(
            b_q, tl.load(p_seq_lens + i_b), p_page_table + i_b * stride_table, p_kv_head, scale_log2,
            stride_kv_page, stride_kv_token, stride_kv_kind, ROWS, HEAD_DIM, PAGE_TOKENS, BLOCK_N, EVEN_TILES,
            PREFETCH_PAGES,
        )
        p_o = p_out + i_b * stride_ot + o_h[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, (b_acc / b_sum[:, None]).to(p_out.dtype.element_ty), mask=m_m[:, None])


def decode_config(**overrides) -> dict:
    """Tiles and flags; the defaults are the general kernel's decode tiles with every flag off."""
    base = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "PROGRAMS_PER_SM": 2}
    return base | {flag: False for flag in DECODE_FLAGS} | overrides


def decode_attention_triton(
    query: torch.Tensor,  # [B, Hq, Dh], one query a request
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], head dim contiguous
    page_table: torch.Tensor,  # [B, max pages] int32
    seq_lens: torch.Tensor,  # [B], >= 1
    scale: float,
    config: dict | None = None,  # decode_config(); PROGRAMS_PER_SM sizes the persistent grid
    num_sms: int = 132,
):
    """Attention of each request's one new token over its whole context; returns [B, Hq, Dh] (and the launch's
    compiled kernel for its shared-memory and register counts)."""
    cfg = config or decode_config()
    num_requests, num_heads, head_dim = query.shape
    _, _, page_tokens, num_kv_heads, _ = kv_view.shape
    assert query.stride(2) == 1 and kv_view.stride(4) == 1, "head dims must be contiguous"
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, "Dh a power of two from 16"
    out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    num_items = num_requests * num_kv_heads
    programs = min(num_items, cfg["PROGRAMS_PER_SM"] * num_sms) if cfg["PERSISTENT"] else num_items
    kernel = _decode_kernel[(programs,)](
        query, kv_view, page_table, seq_lens, out, num_requests, num_kv_heads, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_view.stride(0), kv_view.stride(1), kv_view.stride(2), kv_view.stride(3), page_table.stride(0),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_TOKENS=page_tokens,
        BLOCK_N=cfg["BLOCK_N"], **{flag: cfg[flag] for flag in DECODE_FLAGS},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, kernel
