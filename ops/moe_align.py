"""Sorting the routed (token, k) pairs per expert and padding each expert's run to the M tile, on the device.

Owns `align_tokens`, with fixed upper-bound buffers so it never synchronises with the host and a CUDA graph can hold
it. On CUDA: per-chunk expert counts (at most MAX_SORT_PROGRAMS programs, each a chunk of whole [tile, E] one-hot
tiles), then a scatter; each scatter program sums the counts of the chunks before its own, or past
SCAN_ABOVE_ENTRIES count-table entries one program scans the table first (that sum grew with chunks x experts),
and for decode batches of up to SORTED_PROGRAM_PAIRS pairs one launch of one program does all of it, sorting the
keys expert * pairs + pair in registers, where the torch path's ~25 small launches are host bound (times in
docs/benchmarks/kernels.md). The torch path (argsort, cumsum, scatter) serves CPU. Every path gives the same layout, which the interpreter tests check. A single token
needs no sort: `gemm_layout` gives it `pair_blocks`, one M block a (token, k) pair (so do a few tokens where the
tuned config says `PAIR_BLOCKS`). The atomic sort (`_atomic_count_and_scatter`, where a tuned config says
`ATOMIC_SORT`) counts and places each pair with an atomic instead of one-hot tiles, in two launches and a memset:
its runs hold the same pairs in any order (the other paths keep each run in pair order), which changes no output.
Does not own the GEMMs (`rimuru.ops.paged_moe`).

Layout for BLOCK_M = 4, experts 0 and 2 routed (flat ids f = t * K + k; `_` is the pad id T * K):

    sorted_ids    | f f f _ | f _ _ _ | _ _ _ _ ...  (max_padded entries, an upper bound)
    block_expert  |    0    |    2    |    E    ...  (E: nothing to do, the program exits)
    num_padded    = 8
"""

import torch
import triton
import triton.language as tl

from rimuru.ops.dependent_launch import launch_options, pdl_supported, wait_for_prior_grid

CHUNK = 128  # pairs a sort program holds in registers at most: its [tile, E] one-hot tiles
# count + scatter take tiles smaller than CHUNK while that keeps at least this many programs: the [tile, E]
# one-hot tiles are the kernels' work (with 128-pair tiles most of the two launches' time was the graph's own
# floor on the H200: docs/benchmarks/kernels.md, the sort)
COUNT_PROGRAMS = 16
# a tile holds at most this many one-hot entries: [128, 64] for Qwen1.5's 60 experts, [64, 128] for Qwen3's 128.
# A [128, 128] tile takes 190 registers a thread at 8 warps (ptxas for sm_90, no spills): one program an SM
TILE_ENTRIES = 128 * 64
# count and scatter programs at most (about one wave on an H200's 132 SMs); past that a program takes several
# tiles, which keeps the count table, and the scan of it, at MAX_SORT_PROGRAMS rows
MAX_SORT_PROGRAMS = 128
# past this many count-table entries (chunks x padded experts) one program scans the table into each chunk's first
# rows (a third launch) instead of every scatter program summing all the chunks before its own, a sum that grows with
# the table. on the H200 (kernels.md) the scan won at 128 x 128 (Qwen3, 1,024 and 4,096 tokens)
# and lost at 32 x 64 and 128 x 64 (Qwen1.5)
SCAN_ABOVE_ENTRIES = 128 * 64
SCAN_ENTRIES = 128 * 128  # the scan's tile: the whole table of MAX_SORT_PROGRAMS x 128 experts in one load
ATOMIC_PAIRS_EACH, ATOMIC_TILE = 256, 256  # the atomic sort (`_atomic_count_and_scatter`): a program's pairs, a tile
# up to this many pairs the sort is one program sorting them in registers (`_align_sorted_program_kernel`); it can
# take up to ONE_PROGRAM_MAX_PAIRS (its registers), which the tests and tools force
SORTED_PROGRAM_PAIRS, ONE_PROGRAM_MAX_PAIRS = 256, 1024
FILL_TILE = tl.constexpr(1024)  # pad ids a store writes: the one-program sort fills its 2,048 rows (16 tokens of Qwen3) in two


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sorted rows: each routed expert pads its run by at most BLOCK_M - 1 rows."""
    # NOTE: at most min(E, T * K) experts are routed, so the bound stays small for decode.
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


@triton.jit
def _range_counts(p_ids, start, end, EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr):
    """[E] pairs of each expert among ids[start:end], TILE pairs at a time."""
    o_e = tl.arange(0, EXPERTS_PAD)
    b_count = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for tile_start in range(start, end, TILE):
        o_p = tile_start + tl.arange(0, TILE)
        b_ids = tl.load(p_ids + o_p, mask=o_p < end, other=EXPERTS_PAD)
        b_count += tl.sum((b_ids[:, None] == o_e[None, :]).to(tl.int32), 0)
    return b_count


@triton.jit
def _scatter_range(p_ids, p_sorted_ids, start, end, b_next, EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr):
    """Rows of the pairs ids[start:end], TILE at a time: b_next[e] + rank among e's pairs since `start`; returns
    b_next past them."""
    o_e = tl.arange(0, EXPERTS_PAD)
    for tile_start in range(start, end, TILE):
        o_p = tile_start + tl.arange(0, TILE)
        m_p = o_p < end
        b_ids = tl.load(p_ids + o_p, mask=m_p, other=EXPERTS_PAD)
        b_hot = (b_ids[:, None] == o_e[None, :]).to(tl.int32)  # [TILE, E]
        b_rank = tl.sum(tl.cumsum(b_hot, 0) * b_hot, 1) - 1
        tl.store(p_sorted_ids + tl.sum(b_hot * b_next[None, :], 1) + b_rank, o_p, mask=m_p)
        b_next += tl.sum(b_hot, 0)
    return b_next


@triton.jit
def _padded_runs(b_total, BLOCK_M: tl.constexpr):
    """([E] each expert's run padded to BLOCK_M rows, [E] the end row of each run)."""
    b_padded = (b_total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return b_padded, tl.cumsum(b_padded, 0)


@triton.jit
def _fill_pad_ids(p_sorted_ids, start, end, num_pairs, TILE: tl.constexpr):
    """The pad id (num_pairs) into sorted rows [start, end); the scatter overwrites the real ones."""
    for row_start in range(start, end, TILE):
        o_r = row_start + tl.arange(0, TILE)
        tl.store(p_sorted_ids + o_r, tl.zeros((TILE,), dtype=tl.int32) + num_pairs, mask=o_r < end)


@triton.jit
def _scatter_chunk(p_ids, p_sorted_ids, p_block_expert, p_num_padded, i_c, b_next, b_end, num_pairs, num_experts,
                   max_blocks, blocks_each, pairs_each, BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                   TILE: tl.constexpr):  # fmt: skip
    """Program i_c's part of every scatter: its chunk's pairs from `b_next` (each expert's row for its next pair),
    its share of the block experts from `b_end`, and (program 0) the padded row count."""
    start = i_c * pairs_each
    _scatter_range(p_ids, p_sorted_ids, start, tl.minimum(start + pairs_each, num_pairs), b_next, EXPERTS_PAD, TILE)
    _store_block_experts(p_block_expert, b_end, i_c * blocks_each, tl.minimum(max_blocks, (i_c + 1) * blocks_each),
                         num_experts, BLOCK_M, TILE)
    if i_c == 0:
        tl.store(p_num_padded, tl.max(b_end, 0))


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "pairs_each", "rows_each"])
def _count_kernel(
    p_ids, p_chunk_counts, p_sorted_ids, num_pairs, max_rows, pairs_each, rows_each,
    EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Pairs per expert in this program's chunk of `pairs_each`, and the pad id over its share of the sorted rows."""
    wait_for_prior_grid(USE_PDL)
    i_c = tl.program_id(0)
    start = i_c * pairs_each
    b_count = _range_counts(p_ids, start, tl.minimum(start + pairs_each, num_pairs), EXPERTS_PAD, TILE)
    tl.store(p_chunk_counts + i_c * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), b_count)
    _fill_pad_ids(p_sorted_ids, i_c * rows_each, tl.minimum(max_rows, (i_c + 1) * rows_each), num_pairs, FILL_TILE)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks", "pairs_each"])
def _scatter_kernel(
    p_ids, p_chunk_counts, p_sorted_ids, p_block_expert, p_num_padded,
    num_pairs, num_experts, num_chunks, max_blocks, blocks_each, pairs_each,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr, PREFIX_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each pair of chunk c goes to start[e] + (pairs of e in chunks before c) + (its rank in chunk c); each program
    sums the whole count table for the starts (few chunks: `_scan_kernel` does it once for many)."""
    wait_for_prior_grid(USE_PDL)
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EXPERTS_PAD)
    b_total = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    b_before = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for c_start in range(0, num_chunks, PREFIX_ROWS):  # [PREFIX_ROWS, E] tiles: few dependent loads
        o_c = c_start + tl.arange(0, PREFIX_ROWS)
        b_count = tl.load(p_chunk_counts + o_c[:, None] * EXPERTS_PAD + o_e[None, :], mask=(o_c < num_chunks)[:, None],
                          other=0)
        b_total += tl.sum(b_count, 0)
        b_before += tl.sum(tl.where((o_c < i_c)[:, None], b_count, 0), 0)
    b_padded, b_end = _padded_runs(b_total, BLOCK_M)
    _scatter_chunk(p_ids, p_sorted_ids, p_block_expert, p_num_padded, i_c, b_end - b_padded + b_before, b_end,
                   num_pairs, num_experts, max_blocks, blocks_each, pairs_each, BLOCK_M, EXPERTS_PAD, TILE)


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(p_chunk_counts, p_chunk_rows, num_chunks, BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                 SCAN_ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    """One program: each expert's padded run from the chunk counts, then row c of `p_chunk_rows` = chunk c's first
    row for each expert (its run's start + its pairs in chunks before c); the row after the last holds the runs'
    ends. A table of up to SCAN_ROWS chunks is one tile (the second pass finds it in cache)."""
    wait_for_prior_grid(USE_PDL)
    o_e = tl.arange(0, EXPERTS_PAD)
    b_total = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for c_start in range(0, num_chunks, SCAN_ROWS):
        o_c = c_start + tl.arange(0, SCAN_ROWS)
        b_total += tl.sum(tl.load(p_chunk_counts + o_c[:, None] * EXPERTS_PAD + o_e[None, :],
                                  mask=(o_c < num_chunks)[:, None], other=0), 0)
    b_padded, b_end = _padded_runs(b_total, BLOCK_M)
    b_next = b_end - b_padded  # [E] row of each expert's next pair
    for c_start in range(0, num_chunks, SCAN_ROWS):
        o_c = c_start + tl.arange(0, SCAN_ROWS)
        o_tile = o_c[:, None] * EXPERTS_PAD + o_e[None, :]
        m_c = (o_c < num_chunks)[:, None]
        b_count = tl.load(p_chunk_counts + o_tile, mask=m_c, other=0)
        tl.store(p_chunk_rows + o_tile, b_next[None, :] + tl.cumsum(b_count, 0) - b_count, mask=m_c)
        b_next += tl.sum(b_count, 0)
    tl.store(p_chunk_rows + num_chunks * EXPERTS_PAD + o_e, b_end)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks", "pairs_each"])
def _scatter_scanned_kernel(
    p_ids, p_chunk_rows, p_sorted_ids, p_block_expert, p_num_padded,
    num_pairs, num_experts, num_chunks, max_blocks, blocks_each, pairs_each,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Chunk c's pairs from its first rows (`_scan_kernel`), and this program's share of the block experts."""
    wait_for_prior_grid(USE_PDL)
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EXPERTS_PAD)
    b_next = tl.load(p_chunk_rows + i_c * EXPERTS_PAD + o_e)
    b_end = tl.load(p_chunk_rows + num_chunks * EXPERTS_PAD + o_e)
    _scatter_chunk(p_ids, p_sorted_ids, p_block_expert, p_num_padded, i_c, b_next, b_end, num_pairs, num_experts,
                   max_blocks, blocks_each, pairs_each, BLOCK_M, EXPERTS_PAD, TILE)


@triton.jit
def _store_block_experts(p_block_expert, b_end, block_start, block_end, num_experts, BLOCK_M: tl.constexpr,
                         TILE: tl.constexpr):
    """Each block's expert in [block_start, block_end): searchsorted(b_end, block row, right), E past the last."""
    for start in range(block_start, block_end, TILE):
        o_b = start + tl.arange(0, TILE)
        b_expert = tl.sum((b_end[None, :] <= (o_b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(p_block_expert + o_b, tl.minimum(b_expert, num_experts), mask=o_b < block_end)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])
def _align_sorted_program_kernel(
    p_ids, p_sorted_ids, p_block_expert, p_num_padded, num_pairs, num_experts, max_rows, max_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, PAIRS_PAD: tl.constexpr, BLOCKS_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The whole sort in one program by sorting the keys expert * PAIRS_PAD + pair in registers: the i-th key's pair
    goes to row i plus the padding of the runs before its expert's. No [pairs, E] one-hot tile: a histogram, a
    bitonic sort and a gather. The same layout as the other paths (each run in pair order)."""
    wait_for_prior_grid(USE_PDL)
    o_p = tl.arange(0, PAIRS_PAD)
    m_p = o_p < num_pairs
    b_ids = tl.load(p_ids + o_p, mask=m_p, other=0).to(tl.int32)
    o_e = tl.arange(0, EXPERTS_PAD)
    b_count = tl.histogram(b_ids, EXPERTS_PAD) - tl.where(o_e == 0, PAIRS_PAD - num_pairs, 0)  # masked pairs read 0
    b_padded, b_end = _padded_runs(b_count, BLOCK_M)
    b_padding_before = b_end - b_padded - (tl.cumsum(b_count, 0) - b_count)  # [E]
    b_key = tl.sort(tl.where(m_p, b_ids, EXPERTS_PAD) * PAIRS_PAD + o_p)  # the masked pairs sort last
    b_expert = tl.minimum(b_key // PAIRS_PAD, EXPERTS_PAD - 1)
    _fill_pad_ids(p_sorted_ids, 0, max_rows, num_pairs, FILL_TILE)
    tl.debug_barrier()  # NOTE: the pad ids above must land before the pair ids that overwrite some of them
    tl.store(p_sorted_ids + o_p + tl.gather(b_padding_before, b_expert, 0), b_key % PAIRS_PAD, mask=m_p)
    _store_block_experts(p_block_expert, b_end, 0, max_blocks, num_experts, BLOCK_M, BLOCKS_TILE)
    tl.store(p_num_padded, tl.max(b_end, 0))


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "max_rows", "max_blocks", "pairs_each", "rows_each",
                               "num_programs"])  # fmt: skip
def _atomic_count_kernel(
    p_ids, p_counts, p_cursor, p_sorted_ids, p_block_expert, p_num_padded, num_pairs, num_experts, max_rows,
    max_blocks, pairs_each, rows_each, num_programs,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, TILE: tl.constexpr, BLOCKS_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each program adds its pairs to the [E] counts (an atomic a pair, no one-hot tile) and fills its share of
    the rows with the pad id; the last program to finish (an atomic ticket after the counts, `p_counts[E_PAD]`)
    pads the runs, sets each expert's cursor to its run's start, and writes the block experts and the row count."""
    wait_for_prior_grid(USE_PDL)
    i_c = tl.program_id(0)
    start = i_c * pairs_each
    end = tl.minimum(start + pairs_each, num_pairs)
    for tile_start in range(start, end, TILE):
        o_p = tile_start + tl.arange(0, TILE)
        m_p = o_p < end
        tl.atomic_add(p_counts + tl.load(p_ids + o_p, mask=m_p, other=0), 1, mask=m_p, sem="relaxed")
    _fill_pad_ids(p_sorted_ids, i_c * rows_each, tl.minimum(max_rows, (i_c + 1) * rows_each), num_pairs, FILL_TILE)
    tl.debug_barrier()  # NOTE: every thread's counts before the ticket's release
    if tl.atomic_add(p_counts + EXPERTS_PAD, 1, sem="acq_rel") == num_programs - 1:
        o_e = tl.arange(0, EXPERTS_PAD)
        b_total = tl.atomic_add(p_counts + o_e, 0, mask=o_e < num_experts, sem="acq_rel")  # coherent reads
        b_total = tl.where(o_e < num_experts, b_total, 0)
        b_padded, b_end = _padded_runs(b_total, BLOCK_M)
        tl.store(p_cursor + o_e, b_end - b_padded)
        _store_block_experts(p_block_expert, b_end, 0, max_blocks, num_experts, BLOCK_M, BLOCKS_TILE)
        tl.store(p_num_padded, tl.max(b_end, 0))


@triton.jit(do_not_specialize=["num_pairs", "pairs_each"])
def _atomic_scatter_kernel(p_ids, p_cursor, p_sorted_ids, num_pairs, pairs_each, TILE: tl.constexpr,
                           USE_PDL: tl.constexpr):  # fmt: skip
    """Each pair takes the next row of its expert's run (an atomic on the expert's cursor): within a run the pairs
    land in any order, which no output depends on (a GEMM row is computed alone, the top-k sum goes by k)."""
    wait_for_prior_grid(USE_PDL)
    start = tl.program_id(0) * pairs_each
    end = tl.minimum(start + pairs_each, num_pairs)
    for tile_start in range(start, end, TILE):
        o_p = tile_start + tl.arange(0, TILE)
        m_p = o_p < end
        b_row = tl.atomic_add(p_cursor + tl.load(p_ids + o_p, mask=m_p, other=0), 1, mask=m_p, sem="relaxed")
        tl.store(p_sorted_ids + b_row, o_p, mask=m_p)


def _atomic_count_and_scatter(ids, out, num_experts: int, block_m: int, pairs_each: int = ATOMIC_PAIRS_EACH,
                              pdl: bool = False) -> None:  # fmt: skip
    """The sort in two launches and a memset, with atomics (`_atomic_count_kernel`, `_atomic_scatter_kernel`)."""
    sorted_ids, block_expert, num_padded = out
    num_pairs, experts_pad = ids.numel(), triton.next_power_of_2(num_experts)
    num_programs = triton.cdiv(num_pairs, pairs_each)
    counts = torch.zeros(experts_pad + 1, dtype=torch.int32, device=ids.device)  # [E_PAD] counts, then the ticket
    cursor = torch.empty(experts_pad, dtype=torch.int32, device=ids.device)
    tile = min(pairs_each, ATOMIC_TILE)
    _atomic_count_kernel[(num_programs,)](
        ids, counts, cursor, sorted_ids, block_expert, num_padded, num_pairs, num_experts, sorted_ids.numel(),
        block_expert.numel(), pairs_each, triton.cdiv(sorted_ids.numel(), num_programs), num_programs,
        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, TILE=tile, BLOCKS_TILE=max(16, TILE_ENTRIES // experts_pad // 2),
        USE_PDL=pdl, num_warps=4, **launch_options(pdl),
    )
    _atomic_scatter_kernel[(num_programs,)](ids, cursor, sorted_ids, num_pairs, pairs_each, TILE=tile, USE_PDL=pdl,
                                            num_warps=4, **launch_options(pdl))  # fmt: skip


def tile_chunk(num_experts: int) -> int:
    """The most pairs a [tile, E] one-hot tile may hold (TILE_ENTRIES): 128 for 60 experts, 64 for 128."""
    return min(CHUNK, max(16, TILE_ENTRIES // triton.next_power_of_2(num_experts)))


def count_chunk(num_pairs: int, num_experts: int) -> int:
    """Pairs a count (and scatter) tile holds: `tile_chunk`, or less while the tiles stay at least COUNT_PROGRAMS
    (a power of two, at least 16): 512 pairs -> 32."""
    return min(tile_chunk(num_experts), max(16, triton.next_power_of_2(triton.cdiv(num_pairs, COUNT_PROGRAMS))))


def scan_rows(num_chunks: int, experts_pad: int) -> int:
    """Count-table rows `_scan_kernel` loads a pass: every chunk (up to MAX_SORT_PROGRAMS) in one tile of at most
    SCAN_ENTRIES entries."""
    return min(triton.next_power_of_2(num_chunks), max(1, SCAN_ENTRIES // experts_pad))


def scans_counts(num_chunks: int, experts_pad: int) -> bool:
    """Whether the count-and-scatter sort scans its count table once (SCAN_ABOVE_ENTRIES)."""
    return num_chunks * experts_pad > SCAN_ABOVE_ENTRIES


def sort_chunks(num_pairs: int, tile: int, max_programs: int = MAX_SORT_PROGRAMS) -> tuple[int, int]:
    """(pairs a count and scatter program takes, programs): one tile each, or whole tiles enough for at most
    `max_programs` programs. Qwen3 at 4096 tokens: 32,768 pairs in 64-pair tiles -> 256 pairs each, 128 programs."""
    pairs_each = triton.cdiv(triton.cdiv(num_pairs, tile), max_programs) * tile
    return pairs_each, triton.cdiv(num_pairs, pairs_each)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None,
                        chunk: int | None = None, scan: bool | None = None, max_programs: int = MAX_SORT_PROGRAMS,
                        atomic: bool = False, pdl: bool = False):  # fmt: skip
    """`align_tokens` in one launch of one program sorting the pairs in registers up to SORTED_PROGRAM_PAIRS, else
    count then scatter (at most `max_programs` programs, each whole tiles of `count_chunk` pairs, or `chunk`), with
    a scan of the counts between the two past SCAN_ABOVE_ENTRIES (`scans_counts`); with `atomic` the atomic sort,
    whose runs hold their pairs in any order. `one_program` and `scan` force a path. `pdl`: each launch dependent on
    the one before it (`rimuru.ops.dependent_launch`), where the device can."""
    num_pairs = topk_ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    out = (torch.empty(max_rows, dtype=torch.int32, device=topk_ids.device),  # sorted_ids
           torch.empty(max_rows // block_m, dtype=torch.int32, device=topk_ids.device),  # block_expert
           torch.empty(1, dtype=torch.int32, device=topk_ids.device))  # num_padded
    ids = topk_ids.contiguous()
    if one_program is None:
        one_program = not atomic and num_pairs <= SORTED_PROGRAM_PAIRS
    assert not one_program or num_pairs <= ONE_PROGRAM_MAX_PAIRS, f"{num_pairs} pairs are too many for one program"
    pdl = pdl and pdl_supported(ids.device)
    if one_program:
        _sorted_program(ids, out, num_experts, block_m, pdl)
    elif atomic:
        _atomic_count_and_scatter(ids, out, num_experts, block_m, pdl=pdl)
    else:
        _count_and_scatter(ids, out, num_experts, block_m, chunk or count_chunk(num_pairs, num_experts), scan,
                           max_programs, pdl)  # fmt: skip
    return out


def _sorted_program(ids, out, num_experts: int, block_m: int, pdl: bool) -> None:
    """The sort as one program sorting the pairs in registers (`_align_sorted_program_kernel`), into `out`."""
    sorted_ids, block_expert, _ = out
    experts_pad = triton.next_power_of_2(num_experts)
    _align_sorted_program_kernel[(1,)](
        ids, *out, ids.numel(), num_experts, sorted_ids.numel(), block_expert.numel(), BLOCK_M=block_m,
        EXPERTS_PAD=experts_pad, PAIRS_PAD=max(16, triton.next_power_of_2(ids.numel())),
        BLOCKS_TILE=max(16, TILE_ENTRIES // experts_pad), USE_PDL=pdl, num_warps=4, **launch_options(pdl),
    )


def _count_and_scatter(ids, out, num_experts: int, block_m: int, tile: int, scan: bool | None,
                       max_programs: int, pdl: bool = False) -> None:  # fmt: skip
    """The sort in two launches (count, scatter), or three with the scan between them, into `out`."""
    sorted_ids, block_expert, _ = out
    num_pairs, experts_pad = ids.numel(), triton.next_power_of_2(num_experts)
    pairs_each, num_chunks = sort_chunks(num_pairs, tile, max_programs)
    chunk_counts = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=ids.device)
    _count_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, num_pairs, sorted_ids.numel(), pairs_each,
        triton.cdiv(sorted_ids.numel(), num_chunks), EXPERTS_PAD=experts_pad, TILE=tile, USE_PDL=pdl, num_warps=8,
        **launch_options(pdl),
    )
    max_blocks = block_expert.numel()  # and below: a program's share of the blocks, and its pairs
    sizes = (num_pairs, num_experts, num_chunks, max_blocks, triton.cdiv(max_blocks, num_chunks), pairs_each)
    use_scan = scans_counts(num_chunks, experts_pad) if scan is None else scan
    if use_scan:
        chunk_rows = torch.empty(num_chunks + 1, experts_pad, dtype=torch.int32, device=ids.device)
        _scan_kernel[(1,)](chunk_counts, chunk_rows, num_chunks, BLOCK_M=block_m, EXPERTS_PAD=experts_pad,
                           SCAN_ROWS=scan_rows(num_chunks, experts_pad), USE_PDL=pdl, num_warps=8,
                           **launch_options(pdl))  # fmt: skip
        _scatter_scanned_kernel[(num_chunks,)](ids, chunk_rows, *out, *sizes, BLOCK_M=block_m,
                                               EXPERTS_PAD=experts_pad, TILE=tile, USE_PDL=pdl, num_warps=8,
                                               **launch_options(pdl))  # fmt: skip
    else:
        _scatter_kernel[(num_chunks,)](ids, chunk_counts, *out, *sizes, BLOCK_M=block_m, EXPERTS_PAD=experts_pad,
                                       TILE=tile, PREFIX_ROWS=max(1, 4096 // experts_pad), USE_PDL=pdl, num_warps=8,
                                       **launch_options(pdl))  # fmt: skip


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int, atomic: bool = False, pdl: bool = False):
    """(sorted_ids [R], block_expert [R / BLOCK_M], num_padded [1]) for `topk_ids` [T, K]; no host sync. `atomic`:
    the atomic sort on CUDA (runs in any order; the torch path keeps pair order); `pdl`: dependent launches."""
    if topk_ids.is_cuda and topk_ids.numel() > 0:
        return align_tokens_triton(topk_ids, num_experts, block_m, atomic=atomic, pdl=pdl)
    return align_tokens_torch(topk_ids, num_experts, block_m)


def pair_blocks(topk_ids: torch.Tensor) -> tuple[None, torch.Tensor, None]:
    """The layout of one block a (token, k) pair, for `rimuru.ops.paged_moe.moe_gemms`: no sort, no launch (a view
    of the ids). For one token, whose top-k experts are distinct, it reads what the sorted layout reads: each routed
    expert once, in an M tile of one real row either way."""
    return None, topk_ids.reshape(-1), None


def uses_pair_blocks(num_tokens: int, tuned: bool | None = None) -> bool:
    """Whether the GEMMs run one M block a pair: as a tuned config says (`PAIR_BLOCKS`), else for one token only."""
    return num_tokens == 1 if tuned is None else tuned


def gemm_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int, tuned_pairs: bool | None = None,
                atomic_sort: bool = False, pdl: bool = False):  # fmt: skip
    """The M blocks the GEMMs run: `pair_blocks` for one token, whose top-k experts are distinct (at one token
    the sort was a third of Qwen3's op on the H200 and bought nothing: docs/benchmarks/kernels.md), or where a tuned config says so
    (`PAIR_BLOCKS`: a few tokens, whose experts seldom repeat; an expert two pairs share is read twice), else
    `align_tokens` (the atomic sort where a tuned config says `ATOMIC_SORT`)."""
    if uses_pair_blocks(topk_ids.shape[0], tuned_pairs):
        return pair_blocks(topk_ids)
    return align_tokens(topk_ids, num_experts, block_m, atomic_sort, pdl)


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
