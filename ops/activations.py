"""`rimuru::silu_and_mul` (SwiGLU's activation) and `rimuru::sigmoid_gated_add` (qwen2_moe's gated shared expert
added to the routed experts' output): the MLP epilogues, each one kernel where torch launches two or three.

Owns two Triton kernels and their launchers; the references are in `rimuru.ops.reference`. Each intermediate is
rounded to the dtype as torch's separate ops round it, so bf16 outputs equal the torch form's up to the last bit of
the sigmoid.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.rounding import rounded

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(p_x, p_out, num_features, stride_x, BLOCK: tl.constexpr):
    i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_f = i_b * BLOCK + tl.arange(0, BLOCK)
    m_f = o_f < num_features
    gate = tl.load(p_x + i_t * stride_x + o_f, mask=m_f, other=0.0).to(tl.float32)
    up = tl.load(p_x + i_t * stride_x + num_features + o_f, mask=m_f, other=0.0).to(tl.float32)
    dtype = p_out.dtype.element_ty
    act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(p_out + i_t * num_features + o_f, (act * up).to(dtype), mask=m_f)


@triton.jit
def _sigmoid_gated_add_kernel(p_base, p_gate, p_x, p_out, hidden_size, stride_base, stride_gate, stride_x,
                              BLOCK: tl.constexpr):  # fmt: skip
    i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_b * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < hidden_size
    dtype = p_out.dtype.element_ty
    logit = tl.load(p_gate + i_t * stride_gate).to(tl.float32)
    gate = rounded(1.0 / (1.0 + tl.exp(-logit)), dtype)
    x = tl.load(p_x + i_t * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    base = tl.load(p_base + i_t * stride_base + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(p_out + i_t * hidden_size + o_d, (base + rounded(gate * x, dtype)).to(dtype), mask=m_d)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
    num_tokens, num_features = x.shape[0], x.shape[1] // 2
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous"
    out = torch.empty(num_tokens, num_features, dtype=x.dtype, device=x.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(num_features, BLOCK))](x, out, num_features, x.stride(0),
                                                                             BLOCK=BLOCK)  # fmt: skip
    return out


def sigmoid_gated_add_triton(base: torch.Tensor, gate_logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    num_tokens, hidden_size = base.shape
    assert base.stride(1) == 1 and x.stride(1) == 1 and gate_logits.shape == (num_tokens, 1)
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(hidden_size, BLOCK))
        _sigmoid_gated_add_kernel[grid](base, gate_logits, x, out, hidden_size, base.stride(0), gate_logits.stride(0),
                                        x.stride(0), BLOCK=BLOCK)  # fmt: skip
    return out


@torch.library.custom_op("rimuru::silu_and_mul", mutates_args=(), device_types="cpu")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return reference.silu_and_mul(x)


@silu_and_mul.register_kernel("cuda")
def _silu_and_mul_cuda(x):
    return silu_and_mul_triton(x)


@silu_and_mul.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("rimuru::sigmoid_gated_add", mutates_args=(), device_types="cpu")
def sigmoid_gated_add(base: torch.Tensor, gate_logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return reference.sigmoid_gated_add(base, gate_logits, x)


@sigmoid_gated_add.register_kernel("cuda")
def _sigmoid_gated_add_cuda(base, gate_logits, x):
    return sigmoid_gated_add_triton(base, gate_logits, x)


@sigmoid_gated_add.register_fake
def _sigmoid_gated_add_fake(base, gate_logits, x):
    return torch.empty_like(base)
