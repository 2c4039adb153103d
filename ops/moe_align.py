"""Sorting the routed (token, k) pairs per expert and padding each expert's run to the M tile, on the device.

Owns `align_tokens`, with fixed upper-bound buffers so it never synchronises with the host and a CUDA graph can hold
it: for few pairs (decode) one single-program Triton kernel (one launch instead of some 25 small torch ops), else
torch ops (argsort, cumsum, scatter). Both give the same layout. Does not own the GEMMs (`rimuru.ops.paged_moe`).

Layout for BLOCK_M = 4, experts 0 and 2 routed (flat ids f = t * K + k; `_` is the pad id T * K):

    sorted_ids    | f f f _ | f _ _ _ | _ _ _ _ ...  (max_padded entries, an upper bound)
    block_expert  |    0    |    2    |    E    ...  (E: nothing to do, the program exits)
    num_padded    = 8
"""

import torch
import triton
import triton.language as tl

MAX_PAIRS_ONE_PROGRAM = 1024  # above this the single-program kernel's serial loop loses to torch's sort


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sorted rows: each routed expert pads its run by at most BLOCK_M - 1 rows."""
    # NOTE: at most min(E, T * K) experts are routed, so the bound stays small for decode.
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


@triton.jit
def _align_kernel(
    p_ids, p_sorted_ids, p_block_expert, p_num_padded, num_pairs, num_experts, max_rows,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    o_e = tl.arange(0, EXPERTS_PAD)
    b_count = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):  # pass 1: pairs per expert
        o_p = start + tl.arange(0, CHUNK)
        b_ids = tl.load(p_ids + o_p, mask=o_p < num_pairs, other=EXPERTS_PAD)
        b_count += tl.sum((b_ids[:, None] == o_e[None, :]).to(tl.int32), 0)
    b_padded = (b_count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_end = tl.cumsum(b_padded, 0)  # [E] end row of each expert's run
    b_start = b_end - b_padded
    tl.store(p_num_padded, tl.sum(b_padded, 0))
    for start in range(0, max_rows, CHUNK):  # pad ids, and each block's expert (searchsorted right)
        o_r = start + tl.arange(0, CHUNK)
        tl.store(p_sorted_ids + o_r, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=o_r < max_rows)
        m_b = o_r < max_rows // BLOCK_M
        b_expert = tl.sum((b_end[None, :] <= (o_r * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(p_block_expert + o_r, tl.minimum(b_expert, num_experts), mask=m_b)
    tl.debug_barrier()  # NOTE: the pad ids above must land before the real ids below overwrite some of them
    b_seen = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):  # pass 2: scatter each pair to start[e] + its rank within e
        o_p = start + tl.arange(0, CHUNK)
        m_p = o_p < num_pairs
        b_ids = tl.load(p_ids + o_p, mask=m_p, other=EXPERTS_PAD)
        b_hot = (b_ids[:, None] == o_e[None, :]).to(tl.int32)  # [CHUNK, E]
        b_rank = tl.sum(tl.cumsum(b_hot, 0) * b_hot, 1) - 1
        b_row = tl.sum(b_hot * (b_start + b_seen)[None, :], 1) + b_rank
        tl.store(p_sorted_ids + b_row, o_p, mask=m_p)
        b_seen += tl.sum(b_hot, 0)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align_tokens` in one single-program launch."""
    num_pairs = topk_ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](
        topk_ids.contiguous(), sorted_ids, block_expert, num_padded, num_pairs, num_experts, max_rows,
        BLOCK_M=block_m, EXPERTS_PAD=triton.next_power_of_2(num_experts), CHUNK=64, num_warps=8,
    )
    return sorted_ids, block_expert, num_padded


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids [R], block_expert [R / BLOCK_M], num_padded [1]) for `topk_ids` [T, K]; no host sync."""
    if topk_ids.is_cuda and topk_ids.numel() <= MAX_PAIRS_ONE_PROGRAM:
        return align_tokens_triton(topk_ids, num_experts, block_m)
    return align_tokens_torch(topk_ids, num_experts, block_m)


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
