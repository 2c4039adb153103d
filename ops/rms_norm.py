"""`rimuru::rms_norm`: RMSNorm over the last dimension in one pass (transformers' Qwen numerics), and
`rimuru::add_rms_norm`, the residual add before it in the same pass.

Owns two Triton kernels and their launchers; the references are `rimuru.ops.reference.rms_norm` and
`add_rms_norm`. The torch form launches
about eight kernels a norm (cast, square, mean, add, rsqrt, scale, cast, weight) and Qwen1.5-MoE runs 49 norms a
step: most of a decode step's small elementwise kernels. Rows are normalised in fp32 and, as in transformers,
rounded to the input dtype before the weight multiplies them.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.rounding import rounded


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


@triton.jit
def _add_rms_norm_kernel(p_x, p_residual, p_weight, p_out, p_sum, num_cols, stride_x, stride_residual, stride_out,
                         eps, BLOCK: tl.constexpr):  # fmt: skip
    i_r = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK)
    m_c = o_c < num_cols
    b_x = tl.load(p_x + i_r * stride_x + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_r = tl.load(p_residual + i_r * stride_residual + o_c, mask=m_c, other=0.0).to(tl.float32)
    dtype = p_sum.dtype.element_ty
    b_s = rounded(b_x + b_r, dtype)  # the sum as torch's add leaves it, normalised from there
    tl.store(p_sum + i_r * num_cols + o_c, b_s.to(dtype), mask=m_c)
    b_scale = tl.rsqrt(tl.sum(b_s * b_s, 0) / num_cols + eps)
    b_h = rounded(b_s * b_scale, dtype)  # NOTE: rounded before the weight
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


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):  # [T, N] each
    num_cols = x.shape[-1]
    assert x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype
    assert x.stride(1) == 1 and residual.stride(1) == 1, "rows must be contiguous in the normalised dimension"
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, total, num_cols, x.stride(0), residual.stride(0),
                                            out.stride(0), eps, BLOCK=triton.next_power_of_2(num_cols))  # fmt: skip
    return out, total


@torch.library.custom_op("rimuru::rms_norm", mutates_args=(), device_types="cpu")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    return rms_norm_triton(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)


@torch.library.custom_op("rimuru::add_rms_norm", mutates_args=(), device_types="cpu")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return reference.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps):
    return add_rms_norm_triton(x, residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    return out, torch.empty_like(x)
