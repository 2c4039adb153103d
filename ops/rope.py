"""`rimuru::rope`: the neox rotary embedding of q and k in one kernel (transformers' Qwen numerics).

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.rope`. The torch form launches
a negation, a concatenation, two products and a sum for each of q and k in every layer of a step. One program
rotates all heads of one token of q or of k; q and k may be views into the fused QKV projection (any token
stride), the outputs are contiguous. Each product is rounded to the dtype before the sum, as transformers'
`q * cos + rotate_half(q) * sin` rounds it, so bf16 outputs equal the torch form's.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.rounding import bf16_rounded


@triton.jit
def _rotate_heads(p_x, p_out, p_cos, p_sin, i_t, num_heads, stride_xt, stride_xh, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):  # fmt: skip
    o_h = tl.arange(0, BLOCK_H)[:, None]
    o_d = tl.arange(0, HALF)[None, :]
    m_h = o_h < num_heads
    p_row = p_x + i_t * stride_xt + o_h * stride_xh + o_d
    x1 = tl.load(p_row, mask=m_h, other=0.0)  # [BH, Dh / 2]
    x2 = tl.load(p_row + HALF, mask=m_h, other=0.0)
    c1, c2 = tl.load(p_cos + i_t * 2 * HALF + o_d), tl.load(p_cos + i_t * 2 * HALF + HALF + o_d)  # [1, Dh / 2]
    s1, s2 = tl.load(p_sin + i_t * 2 * HALF + o_d), tl.load(p_sin + i_t * 2 * HALF + HALF + o_d)
    dtype = p_out.dtype.element_ty
    x1, x2, c1, c2 = x1.to(tl.float32), x2.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32)
    s1, s2 = s1.to(tl.float32), s2.to(tl.float32)
    if dtype == tl.bfloat16:
        out1 = bf16_rounded(x1 * c1) + bf16_rounded(-x2 * s1)
        out2 = bf16_rounded(x2 * c2) + bf16_rounded(x1 * s2)
    else:
        out1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
        out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    p_dst = p_out + i_t * num_heads * 2 * HALF + o_h * 2 * HALF + o_d
    tl.store(p_dst, out1.to(dtype), mask=m_h)
    tl.store(p_dst + HALF, out2.to(dtype), mask=m_h)


@triton.jit
def _rope_kernel(p_q, p_k, p_q_out, p_k_out, p_cos, p_sin, num_q_heads, num_k_heads, stride_qt, stride_qh,
                 stride_kt, stride_kh, HALF: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    i_t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(p_q, p_q_out, p_cos, p_sin, i_t, num_q_heads, stride_qt, stride_qh, HALF, BLOCK_H)
    else:
        _rotate_heads(p_k, p_k_out, p_cos, p_sin, i_t, num_k_heads, stride_kt, stride_kh, HALF, BLOCK_H)


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k rows must be contiguous in the head dim"
    assert cos.is_contiguous() and sin.is_contiguous() and head_dim % 2 == 0
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                       device=k.device)  # fmt: skip
    if num_tokens:
        block_h = triton.next_power_of_2(max(num_q_heads, num_k_heads))
        _rope_kernel[(num_tokens, 2)](q, k, q_out, k_out, cos, sin, num_q_heads, num_k_heads, q.stride(0),
                                      q.stride(1), k.stride(0), k.stride(1), HALF=head_dim // 2, BLOCK_H=block_h)  # fmt: skip
    return q_out, k_out


@torch.library.custom_op("rimuru::rope", mutates_args=(), device_types="cpu")
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = reference.rope(q, k, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@rope.register_kernel("cuda")
def _rope_cuda(q, k, cos, sin):
    return rope_triton(q, k, cos, sin)


@rope.register_fake
def _rope_fake(q, k, cos, sin):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
