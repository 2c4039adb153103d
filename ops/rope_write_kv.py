"""`rimuru::rope_write_kv`: an attention layer's inputs from its fused QKV projection in one kernel.

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.rope_write_kv` (`rms_norm` of q
and k per head where the family has q/k norms, `rope`, then `write_kv`). Those were four ops a layer of every step
(six launches: the norms copied their views out of the projection first); here one program takes one token's q
heads, another its k and v heads:

    qkv row t  [ q heads (Hq x Dh) | k heads (Hk x Dh) | v heads (Hk x Dh) ]     (a view: any token stride)
    program (t, 0): q -> per-head RMSNorm (weights given) -> RoPE -> q_out[t]    (contiguous [T, Hq, Dh])
    program (t, 1): k -> per-head RMSNorm (weights given) -> RoPE -> kv_view[slot_t, K]; v -> kv_view[slot_t, V]

The roundings are the unfused ops': the norm in fp32, rounded to the dtype before the weight multiplies it and
after; each rotary product rounded before the sum. RoPE pairs element d with d + Dh/2 (neox): a head row is loaded
once as itself and once rotated by half its width, so the norm's sum of squares sees the whole row.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.rounding import rounded


def q_dtype(qkv: torch.Tensor, q_weight: torch.Tensor | None) -> torch.dtype:
    """q's dtype: the projection's, promoted with the norm weight's as `rms_norm` promotes it."""
    return qkv.dtype if q_weight is None else torch.promote_types(q_weight.dtype, qkv.dtype)


@triton.jit
def _normed_rotated(p_row, p_weight, p_cos, p_sin, num_heads, stride_h, head_dim, eps, NORM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """[BH, BD] fp32: the heads of one token row, RMS-normalised per head when NORM, then rotated."""
    o_h = tl.arange(0, BLOCK_H)[:, None]
    o_d = tl.arange(0, BLOCK_D)[None, :]
    half = head_dim // 2
    o_pair = tl.where(o_d < half, o_d + half, o_d - half)  # the element each one rotates with
    m_x = (o_h < num_heads) & (o_d < head_dim)
    b_x = tl.load(p_row + o_h * stride_h + o_d, mask=m_x, other=0.0).to(tl.float32)  # [BH, BD]
    b_pair = tl.load(p_row + o_h * stride_h + o_pair, mask=m_x, other=0.0).to(tl.float32)
    if NORM:
        b_scale = tl.rsqrt(tl.sum(b_x * b_x, 1) / head_dim + eps)[:, None]  # [BH, 1]
        b_w = tl.load(p_weight + o_d, mask=o_d < head_dim, other=0.0).to(tl.float32)
        b_w_pair = tl.load(p_weight + o_pair, mask=o_d < head_dim, other=0.0).to(tl.float32)
        b_x = rounded(b_w * rounded(b_x * b_scale, DTYPE), DTYPE)  # NOTE: rounded before the weight, as rms_norm
        b_pair = rounded(b_w_pair * rounded(b_pair * b_scale, DTYPE), DTYPE)
    b_cos = tl.load(p_cos + o_d, mask=o_d < head_dim, other=0.0).to(tl.float32)  # [1, BD]
    b_sin = tl.load(p_sin + o_d, mask=o_d < head_dim, other=0.0).to(tl.float32)
    b_pair = tl.where(o_d < half, -b_pair, b_pair)  # rotate_half: [-x2, x1]
    return rounded(b_x * b_cos, DTYPE) + rounded(b_pair * b_sin, DTYPE)


@triton.jit
def _rope_write_kv_kernel(
    p_qkv, p_q_weight, p_k_weight, p_cos, p_sin, p_q_out, p_kv, p_slots,
    num_q_heads, num_kv_heads, head_dim, eps, stride_qkv,
    stride_kv_page, stride_kv_kind, stride_kv_token, stride_kv_head, stride_kv_dim,
    NORM: tl.constexpr, PAGE_TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    p_row = p_qkv + i_t * stride_qkv
    p_cos, p_sin = p_cos + i_t * head_dim, p_sin + i_t * head_dim
    o_h = tl.arange(0, BLOCK_H)[:, None]
    o_d = tl.arange(0, BLOCK_D)[None, :]
    if tl.program_id(1) == 0:
        dtype = p_q_out.dtype.element_ty
        b_q = _normed_rotated(p_row, p_q_weight, p_cos, p_sin, num_q_heads, head_dim, head_dim, eps, NORM, BLOCK_H,
                              BLOCK_D, dtype)  # fmt: skip
        m_q = (o_h < num_q_heads) & (o_d < head_dim)
        tl.store(p_q_out + i_t * num_q_heads * head_dim + o_h * head_dim + o_d, b_q.to(dtype), mask=m_q)
    else:
        slot = tl.load(p_slots + i_t).to(tl.int64)
        if slot >= 0:  # a negative slot is a padding row: nothing to store
            dtype = p_kv.dtype.element_ty
            p_k = p_row + num_q_heads * head_dim
            b_k = _normed_rotated(p_k, p_k_weight, p_cos, p_sin, num_kv_heads, head_dim, head_dim, eps, NORM,
                                  BLOCK_H, BLOCK_D, p_q_out.dtype.element_ty)  # fmt: skip
            m_kv = (o_h < num_kv_heads) & (o_d < head_dim)
            b_v = tl.load(p_k + num_kv_heads * head_dim + o_h * head_dim + o_d, mask=m_kv)
            p_dst = p_kv + (slot // PAGE_TOKENS) * stride_kv_page + (slot % PAGE_TOKENS) * stride_kv_token
            o_dst = o_h * stride_kv_head + o_d * stride_kv_dim
            tl.store(p_dst + o_dst, b_k.to(dtype), mask=m_kv)
            tl.store(p_dst + stride_kv_kind + o_dst, b_v.to(dtype), mask=m_kv)


def rope_write_kv_triton(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hk) * Dh], rows contiguous
    q_weight: torch.Tensor | None,  # [Dh] q's per-head RMSNorm weight, or None: no norms
    k_weight: torch.Tensor | None,  # [Dh]
    eps: float,
    cos: torch.Tensor,  # [T, Dh]
    sin: torch.Tensor,  # [T, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], mutated
    slot_mapping: torch.Tensor,  # [T]
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [T, Hq, Dh]
    num_tokens, head_dim = qkv.shape[0], kv_view.shape[-1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos.is_contiguous() and sin.is_contiguous() and head_dim % 2 == 0
    assert (q_weight is None) == (k_weight is None), "q and k are normalised together or not at all"
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q_dtype(qkv, q_weight), device=qkv.device)
    if num_tokens:
        norm = q_weight is not None
        _rope_write_kv_kernel[(num_tokens, 2)](
            qkv, q_weight if norm else qkv, k_weight if norm else qkv, cos, sin, q_out, kv_view, slot_mapping,
            num_q_heads, num_kv_heads, head_dim, eps, qkv.stride(0), *kv_view.stride(),
            NORM=norm, PAGE_TOKENS=kv_view.shape[2], BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )
    return q_out


@torch.library.custom_op("rimuru::rope_write_kv", mutates_args=("kv_view",), device_types="cpu")
def rope_write_kv(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, kv_view: torch.Tensor, slot_mapping: torch.Tensor,
                  num_q_heads: int, num_kv_heads: int) -> torch.Tensor:  # fmt: skip
    return reference.rope_write_kv(qkv, q_weight, k_weight, eps, cos, sin, kv_view, slot_mapping, num_q_heads,
                                   num_kv_heads)  # fmt: skip


@rope_write_kv.register_kernel("cuda")
def _rope_write_kv_cuda(qkv, q_weight, k_weight, eps, cos, sin, kv_view, slot_mapping, num_q_heads, num_kv_heads):
    return rope_write_kv_triton(qkv, q_weight, k_weight, eps, cos, sin, kv_view, slot_mapping, num_q_heads,
                                num_kv_heads)  # fmt: skip


@rope_write_kv.register_fake
def _rope_write_kv_fake(qkv, q_weight, k_weight, eps, cos, sin, kv_view, slot_mapping, num_q_heads, num_kv_heads):
    return qkv.new_empty((qkv.shape[0], num_q_heads, kv_view.shape[-1]), dtype=q_dtype(qkv, q_weight))
