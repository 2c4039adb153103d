"""`rimuru::write_kv`: store each new token's K and V at its slot of the KV view, in place.

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.write_kv`. Slot s of a token is
page s // S, offset s % S; a negative slot skips the token (padding). The view's strides are used as they are, so
a pool whose KV page stride carries padding works.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference


@triton.jit
def _write_kv_kernel(
    p_key, p_value, p_kv, p_slots,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv_page, stride_kv_kind, stride_kv_token, stride_kv_head, stride_kv_dim,
    PAGE_TOKENS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_t = tl.program_id(0)
    slot = tl.load(p_slots + i_t).to(tl.int64)
    if slot < 0:
        return
    p_dst = p_kv + (slot // PAGE_TOKENS) * stride_kv_page + (slot % PAGE_TOKENS) * stride_kv_token
    for start in range(0, num_kv_heads * head_dim, BLOCK):
        o_x = start + tl.arange(0, BLOCK)  # flat (head, dim) index
        m_x = o_x < num_kv_heads * head_dim
        o_h, o_d = o_x // head_dim, o_x % head_dim
        b_k = tl.load(p_key + i_t * stride_kt + o_h * stride_kh + o_d, mask=m_x)
        b_v = tl.load(p_value + i_t * stride_vt + o_h * stride_vh + o_d, mask=m_x)
        o_dst = o_h * stride_kv_head + o_d * stride_kv_dim
        tl.store(p_dst + o_dst, b_k.to(p_kv.dtype.element_ty), mask=m_x)
        tl.store(p_dst + stride_kv_kind + o_dst, b_v.to(p_kv.dtype.element_ty), mask=m_x)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hk, Dh]
    value: torch.Tensor,  # [T, Hk, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "K and V rows must be contiguous in the head dim"
    block = min(1024, triton.next_power_of_2(num_kv_heads * head_dim))
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_view, slot_mapping,
        num_kv_heads, head_dim, key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv_view.stride(),
        PAGE_TOKENS=kv_view.shape[2], BLOCK=block,
    )


@torch.library.custom_op("rimuru::write_kv", mutates_args=("kv_view",), device_types="cpu")
def write_kv(key: torch.Tensor, value: torch.Tensor, kv_view: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    reference.write_kv(key, value, kv_view, slot_mapping)


@write_kv.register_kernel("cuda")
def _write_kv_cuda(key, value, kv_view, slot_mapping):
    write_kv_triton(key, value, kv_view, slot_mapping)


@write_kv.register_fake
def _write_kv_fake(key, value, kv_view, slot_mapping):
    return None
