"""The MoE op's last step: sum the K router-weighted rows of each token, in a fixed order (no atomics).

Owns one Triton kernel and `topk_sum`, which picks it on CUDA and torch's `.sum(1)` elsewhere (CPU, and the
reference's definition). Each program reads the K rows of one token over BLOCK_D columns, adds them in k order
in fp32 and writes one row in the input's dtype, so a token's output never depends on run-to-run timing:

    pairs [T, K, D]  (row t * K + k of the down kernel's output)      out [T, D]
    program (t, j):  out[t, j*BD : (j+1)*BD] = sum_{k = 0 .. K-1} pairs[t, k, j*BD : (j+1)*BD]   (fp32, k order)

Does not own the GEMMs that write the rows (`rimuru.ops.paged_moe`).

Faster than torch's sum at every shape the MoE op gives it, with 1024 columns and 8 warps a program
(`tools/kernels/bench.py --breakdown`; the figures are in docs/benchmarks/kernels.md).
"""

import torch
import triton
import triton.language as tl

from rimuru.ops.dependent_launch import launch_options, pdl_supported, wait_for_prior_grid

TOPK_SUM_TILES = {"BLOCK_D": 1024, "num_warps": 8}  # 4 bf16 a thread: one 8-byte load per row and thread
KERNEL_ON_CUDA = True  # False: torch's sum on CUDA too


@triton.jit(do_not_specialize=["hidden_size"])
def _topk_sum_kernel(
    p_pairs, p_out, hidden_size, stride_pt, stride_pk, stride_ot,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_prior_grid(USE_PDL)
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < hidden_size
    p_row = p_pairs + i_t * stride_pt + o_d
    b_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # NOTE: unrolled, always k = 0, 1, .. K-1: the order fixes the rounding
        b_acc += tl.load(p_row + k * stride_pk, mask=m_d, other=0.0).to(tl.float32)
    tl.store(p_out + i_t * stride_ot + o_d, b_acc.to(p_out.dtype.element_ty), mask=m_d)


def topk_sum_triton(pairs: torch.Tensor, tiles: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """The Triton kernel on any device (CPU under TRITON_INTERPRET=1); D must be contiguous. [T, K, D] -> [T, D].
    `pdl`: launched dependent on the kernel before it (`rimuru.ops.dependent_launch`), where the device can."""
    num_tokens, top_k, hidden_size = pairs.shape
    assert pairs.stride(2) == 1, "rows must be contiguous"
    tiles = tiles or TOPK_SUM_TILES
    out = torch.empty(num_tokens, hidden_size, dtype=pairs.dtype, device=pairs.device)
    if num_tokens == 0:
        return out
    block_d = min(tiles["BLOCK_D"], triton.next_power_of_2(hidden_size))
    pdl = pdl and pdl_supported(pairs.device)
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_d))](
        pairs, out, hidden_size, pairs.stride(0), pairs.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_D=block_d, USE_PDL=pdl, num_warps=tiles["num_warps"], **launch_options(pdl),
    )
    return out


def topk_sum(pairs: torch.Tensor, pdl: bool = False) -> torch.Tensor:  # [T, K, D] -> [T, D]
    """Sum over k with fp32 accumulation, output in the input's dtype: the kernel on CUDA (with KERNEL_ON_CUDA),
    torch elsewhere."""
    if KERNEL_ON_CUDA and pairs.is_cuda and pairs.stride(2) == 1:
        return topk_sum_triton(pairs, pdl=pdl)
    return pairs.sum(1)
