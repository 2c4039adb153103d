"""`rimuru::rms_norm`: RMSNorm over the last dimension in one pass (transformers' Qwen numerics).

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.rms_norm`. The torch form launches
about eight kernels a norm (cast, square, mean, add, rsqrt, scale, cast, weight) and Qwen1.5-MoE runs 49 norms a
step: most of a decode step's small elementwise kernels. Rows are normalised in fp32 and, as in transformers,
rounded to the input dtype before the weight multiplies them.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference


@triton.jit
def _rms_norm_kernel(p_x, p_weight, p_out, num_cols, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK)
    m_c = o_c < num_cols
    b_x = tl.load(p_x + i_r * stride_x + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_scale = tl.rsqrt(tl.sum(b_x * b_x, 0) / num_cols + eps)
    b_h = (b_x * b_scale).to(p_x.dtype.element_ty).to(tl.float32)  # NOTE: rounded before the weight
    b_w = tl.load(p_weight + o_c, mask=m_c, other=0.0).to(tl.float32)
    tl.store(p_out + i_r * stride_out + o_c, (b_w * b_h).to(p_out.dtype.element_ty), mask=m_c)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x [..., N]
    num_cols = x.shape[-1]
    rows = x.reshape(-1, num_cols)  # [R, N]
    assert rows.stride(1) == 1, "rows must be contiguous in the normalised dimension"
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, num_cols, rows.stride(0), out.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(num_cols))  # fmt: skip
    return out.view(*x.shape[:-1], num_cols)


@torch.library.custom_op("rimuru::rms_norm", mutates_args=(), device_types="cpu")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    return rms_norm_triton(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
