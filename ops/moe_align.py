"""Sorting the routed (token, k) pairs per expert and padding each expert's run to the M tile, on the device.

Owns `align_tokens`: pure torch ops with fixed upper-bound buffers, so it never synchronises with the host and a
CUDA graph or `torch.compile` can hold it. Does not own the GEMMs (`rimuru.ops.paged_moe`).

Layout for BLOCK_M = 4, experts 0 and 2 routed (flat ids f = t * K + k; `_` is the pad id T * K):

    sorted_ids    | f f f _ | f _ _ _ | _ _ _ _ ...  (max_padded entries, an upper bound)
    block_expert  |    0    |    2    |    E    ...  (E: nothing to do, the program exits)
    num_padded    = 8
"""

import torch


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sorted rows: each routed expert pads its run by at most BLOCK_M - 1 rows."""
    # NOTE: at most min(E, T * K) experts are routed, so the bound stays small for decode.
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids [R], block_expert [R / BLOCK_M], num_padded [1]) for `topk_ids` [T, K]; no host sync."""
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
