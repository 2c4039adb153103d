"""Sorting the routed (token, k) pairs per expert and padding each expert's run to the M tile, on the device.

Owns `align_tokens`, with fixed upper-bound buffers so it never synchronises with the host and a CUDA graph can hold
it. On CUDA two Triton launches (per-chunk expert counts, then a scatter that recomputes the prefix it needs; past
SCATTER_PROGRAMS chunks a scatter program takes a run of consecutive chunks, so the count table is read fewer times),
or for decode batches of up to ONE_PROGRAM_CHUNKS chunks one launch of one program that does all of it:
11-16 us for up to 4096 pairs on an H200 (10.7-15.9 us in one program up to 128) against 200-500 us for the torch
path's ~25 small launches (eager, host bound; docs/benchmarks/kernels.json and kernels-breakdown.json). The torch
path (argsort, cumsum, scatter) serves CPU. Both give the same layout, which the interpreter tests check. A single
token needs no sort: `gemm_layout` gives it `pair_blocks`, one M block a (token, k) pair (so do a few tokens where
the tuned config says `PAIR_BLOCKS`). Does not own the GEMMs
(`rimuru.ops.paged_moe`).

Layout for BLOCK_M = 4, experts 0 and 2 routed (flat ids f = t * K + k; `_` is the pad id T * K):

    sorted_ids    | f f f _ | f _ _ _ | _ _ _ _ ...  (max_padded entries, an upper bound)
    block_expert  |    0    |    2    |    E    ...  (E: nothing to do, the program exits)
    num_padded    = 8
"""

import torch
import triton
import triton.language as tl

CHUNK = 128  # pairs a program sorts; [CHUNK, E] one-hot tiles stay in registers
# `bench_kernels.py --breakdown` on the H200 (docs/benchmarks/kernels.md): one program beats count + scatter by
# 2.2-3.4 us at 4-64 pairs (one chunk) and loses from two chunks (15.5 vs 13.2 us at 256 pairs, 42.6 vs 19.5 at
# 512); 64 scatter programs won at 32768 pairs with E = 128 (61.1 vs 71.1 us) and lost at 16384 with E = 60 (18.7
# vs 15.5), so the scatter keeps one program a chunk
SCATTER_PROGRAMS = None  # scatter programs wanted once there are more chunks; None: one program a chunk
ONE_PROGRAM_CHUNKS = 1  # up to this many chunks the whole sort is one launch of one program
# count + scatter take chunks smaller than CHUNK while that keeps at least this many programs: the [chunk, E]
# one-hot tiles are the kernels' work (the two launches took 19.9 us for Qwen3's 512 pairs on the H200, 15 us over
# an almost empty graph, in 128-pair chunks)
COUNT_PROGRAMS = 16


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sorted rows: each routed expert pads its run by at most BLOCK_M - 1 rows."""
    # NOTE: at most min(E, T * K) experts are routed, so the bound stays small for decode.
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def _count_kernel(
    p_ids, p_chunk_counts, p_sorted_ids, num_pairs, max_rows, rows_each,
    EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """Pairs per expert in this program's chunk, and the pad id over this program's share of the sorted rows."""
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EXPERTS_PAD)
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    b_ids = tl.load(p_ids + o_p, mask=o_p < num_pairs, other=EXPERTS_PAD)
    tl.store(p_chunk_counts + i_c * EXPERTS_PAD + o_e, tl.sum((b_ids[:, None] == o_e[None, :]).to(tl.int32), 0))
    row_end = tl.minimum(max_rows, (i_c + 1) * rows_each)
    for start in range(i_c * rows_each, row_end, CHUNK):
        o_r = start + tl.arange(0, CHUNK)
        tl.store(p_sorted_ids + o_r, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=o_r < row_end)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks", "chunks_each"])
def _scatter_kernel(
    p_ids, p_chunk_counts, p_sorted_ids, p_block_expert, p_num_padded,
    num_pairs, num_experts, num_chunks, max_blocks, blocks_each, chunks_each,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr, PREFIX_ROWS: tl.constexpr,
):
    """Each pair of chunk c goes to start[e] + (pairs of e in chunks before c) + (its rank in chunk c); a program
    scatters `chunks_each` consecutive chunks, so the count table is read once per program, not once per chunk."""
    i_p = tl.program_id(0)
    c_first = i_p * chunks_each
    o_e = tl.arange(0, EXPERTS_PAD)
    b_total = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    b_before = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for c_start in range(0, num_chunks, PREFIX_ROWS):  # [PREFIX_ROWS, E] tiles: few dependent loads
        o_c = c_start + tl.arange(0, PREFIX_ROWS)
        b_count = tl.load(p_chunk_counts + o_c[:, None] * EXPERTS_PAD + o_e[None, :], mask=(o_c < num_chunks)[:, None],
                          other=0)
        b_total += tl.sum(b_count, 0)
        b_before += tl.sum(tl.where((o_c < c_first)[:, None], b_count, 0), 0)
    b_padded = (b_total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_end = tl.cumsum(b_padded, 0)  # [E] end row of each expert's run
    b_next = b_end - b_padded + b_before  # [E] row of each expert's next pair
    for i_c in range(c_first, tl.minimum(c_first + chunks_each, num_chunks)):
        b_next = _scatter_chunk(p_ids, p_sorted_ids, i_c, num_pairs, b_next, EXPERTS_PAD, CHUNK)
    _store_block_experts(p_block_expert, b_end, i_p * blocks_each, tl.minimum(max_blocks, (i_p + 1) * blocks_each),
                         num_experts, BLOCK_M, CHUNK)
    if i_p == 0:
        tl.store(p_num_padded, tl.sum(b_padded, 0))


@triton.jit
def _scatter_chunk(p_ids, p_sorted_ids, i_c, num_pairs, b_next, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Rows of chunk i_c's pairs: b_next[e] + rank among e's pairs of the chunk; returns b_next past them."""
    o_e = tl.arange(0, EXPERTS_PAD)
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    m_p = o_p < num_pairs
    b_ids = tl.load(p_ids + o_p, mask=m_p, other=EXPERTS_PAD)
    b_hot = (b_ids[:, None] == o_e[None, :]).to(tl.int32)  # [CHUNK, E]
    b_rank = tl.sum(tl.cumsum(b_hot, 0) * b_hot, 1) - 1
    tl.store(p_sorted_ids + tl.sum(b_hot * b_next[None, :], 1) + b_rank, o_p, mask=m_p)
    return b_next + tl.sum(b_hot, 0)


@triton.jit
def _store_block_experts(p_block_expert, b_end, block_start, block_end, num_experts, BLOCK_M: tl.constexpr,
                         CHUNK: tl.constexpr):
    """Each block's expert in [block_start, block_end): searchsorted(b_end, block row, right), E past the last."""
    for start in range(block_start, block_end, CHUNK):
        o_b = start + tl.arange(0, CHUNK)
        b_expert = tl.sum((b_end[None, :] <= (o_b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(p_block_expert + o_b, tl.minimum(b_expert, num_experts), mask=o_b < block_end)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])
def _align_one_program_kernel(
    p_ids, p_sorted_ids, p_block_expert, p_num_padded, num_pairs, num_experts, max_rows, max_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """The whole sort in one program (decode batches): count, pad, scatter and block experts, one launch."""
    o_e = tl.arange(0, EXPERTS_PAD)
    b_total = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        o_p = start + tl.arange(0, CHUNK)
        b_ids = tl.load(p_ids + o_p, mask=o_p < num_pairs, other=EXPERTS_PAD)
        b_total += tl.sum((b_ids[:, None] == o_e[None, :]).to(tl.int32), 0)
    b_padded = (b_total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_end = tl.cumsum(b_padded, 0)  # [E] end row of each expert's run
    for start in range(0, max_rows, CHUNK):
        o_r = start + tl.arange(0, CHUNK)
        tl.store(p_sorted_ids + o_r, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=o_r < max_rows)
    tl.debug_barrier()  # NOTE: the pad ids above must land before the pair ids that overwrite some of them
    b_next = b_end - b_padded
    for i_c in range(tl.cdiv(num_pairs, CHUNK)):
        b_next = _scatter_chunk(p_ids, p_sorted_ids, i_c, num_pairs, b_next, EXPERTS_PAD, CHUNK)
    _store_block_experts(p_block_expert, b_end, 0, max_blocks, num_experts, BLOCK_M, CHUNK)
    tl.store(p_num_padded, tl.sum(b_padded, 0))


def one_program_chunk(num_pairs: int) -> int:
    """Pairs the one-program sort takes a pass: the batch's pairs to the next power of two (at least 16, at most
    CHUNK). Its [chunk, E] one-hot tiles are the kernel's work: at 8 or 64 pairs a 128-row tile is 16x or 2x too
    big (H200, ff88579: 15.5 us for 8 pairs with E = 128 against 10.5 with E = 64, in 128-row tiles)."""
    return min(CHUNK, max(16, triton.next_power_of_2(num_pairs)))


def count_chunk(num_pairs: int) -> int:
    """Pairs a count (and scatter) program takes: CHUNK, or less while the chunks stay at least COUNT_PROGRAMS
    (a power of two, at least 16): 512 pairs -> 32 a program."""
    return min(CHUNK, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, COUNT_PROGRAMS))))


def scatter_chunks_each(num_chunks: int) -> int:
    """Chunks a scatter program takes: one up to SCATTER_PROGRAMS chunks, then enough to keep that many programs
    (each reads the whole [chunks, E] count table: 256 programs x 128 KB at 32768 pairs and E = 128)."""
    return 1 if SCATTER_PROGRAMS is None else max(1, num_chunks // SCATTER_PROGRAMS)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunks_each: int | None = None,
                        one_program: bool | None = None, chunk: int | None = None):
    """`align_tokens` in one launch of one program up to ONE_PROGRAM_CHUNKS chunks of pairs, else in two: count
    (one program a chunk of `count_chunk` pairs, or `chunk`), then scatter (`chunks_each` chunks a program,
    `scatter_chunks_each` by default). `one_program` forces either path."""
    device, num_pairs = topk_ids.device, topk_ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    experts_pad = triton.next_power_of_2(num_experts)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.contiguous()
    use_one_program = triton.cdiv(num_pairs, CHUNK) <= ONE_PROGRAM_CHUNKS if one_program is None else one_program
    if use_one_program:
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, block_expert, num_padded, num_pairs, num_experts, max_rows, block_expert.numel(),
            BLOCK_M=block_m, EXPERTS_PAD=experts_pad, CHUNK=one_program_chunk(num_pairs), num_warps=8,
        )
        return sorted_ids, block_expert, num_padded
    chunk = chunk or count_chunk(num_pairs)
    num_chunks = triton.cdiv(num_pairs, chunk)
    chunk_counts = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, num_pairs, max_rows, triton.cdiv(max_rows, num_chunks),
        EXPERTS_PAD=experts_pad, CHUNK=chunk, num_warps=8,
    )
    chunks_each = chunks_each or scatter_chunks_each(num_chunks)
    num_programs = triton.cdiv(num_chunks, chunks_each)
    _scatter_kernel[(num_programs,)](
        ids, chunk_counts, sorted_ids, block_expert, num_padded, num_pairs, num_experts, num_chunks,
        block_expert.numel(), triton.cdiv(block_expert.numel(), num_programs), chunks_each,
        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, CHUNK=chunk, PREFIX_ROWS=max(1, 4096 // experts_pad), num_warps=8,
    )
    return sorted_ids, block_expert, num_padded


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids [R], block_expert [R / BLOCK_M], num_padded [1]) for `topk_ids` [T, K]; no host sync."""
    if topk_ids.is_cuda and topk_ids.numel() > 0:
        return align_tokens_triton(topk_ids, num_experts, block_m)
    return align_tokens_torch(topk_ids, num_experts, block_m)


def pair_blocks(topk_ids: torch.Tensor) -> tuple[None, torch.Tensor, None]:
    """The layout of one block a (token, k) pair, for `rimuru.ops.paged_moe.moe_gemms`: no sort, no launch (a view
    of the ids). For one token, whose top-k experts are distinct, it reads what the sorted layout reads: each routed
    expert once, in an M tile of one real row either way."""
    return None, topk_ids.reshape(-1), None


def uses_pair_blocks(num_tokens: int, tuned: bool | None = None) -> bool:
    """Whether the GEMMs run one M block a pair: as a tuned config says (`PAIR_BLOCKS`), else for one token only."""
    return num_tokens == 1 if tuned is None else tuned


def gemm_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int, tuned_pairs: bool | None = None):
    """The M blocks the GEMMs run: `pair_blocks` for one token, whose top-k experts are distinct (the sort took
    15.5 us of Qwen3's 50.7 us op at one token on the H200 and bought nothing), or where a tuned config says so
    (`PAIR_BLOCKS`: a few tokens, whose experts seldom repeat; an expert two pairs share is read twice), else
    `align_tokens`."""
    if uses_pair_blocks(topk_ids.shape[0], tuned_pairs):
        return pair_blocks(topk_ids)
    return align_tokens(topk_ids, num_experts, block_m)


def align_tokens_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align_tokens` in torch ops."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T * K]
    num_pairs = flat.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [T * K] flat ids, grouped by expert
    expert_of = flat[order]  # [T * K]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank  # [T * K] row of each pair in the sorted layout
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=device)  # [R / BLOCK_M]
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)
