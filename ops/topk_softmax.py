"""`rimuru::topk_softmax`: the router's softmax, top-k and optional renormalisation in one kernel.

Owns one Triton kernel and its launcher; the reference is `rimuru.ops.reference.topk_softmax`. In torch the three
take a softmax kernel and `topk`'s two (a radix select and a sort) in every MoE layer of a step. One program takes
BLOCK_T tokens' fp32 logits [BLOCK_T, E]: the softmax in fp32, then K rounds that take each row's largest weight
(the lowest expert id on a tie) and strike it out, so the ids come best first, as `torch.topk` returns them. A row
of NaN logits (garbage upstream) gets garbage weights but ids in range, so the MoE kernels never index past a table.
Rows flagged in `padding_rows` (a CUDA graph's rows past the batch) read row 0's logits, so they route as row 0.
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference

BLOCK_T = 16


@triton.jit
def _topk_softmax_kernel(p_logits, p_padding, p_ids, p_weights, num_tokens, num_experts, stride_lt,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, PADDING: tl.constexpr, K_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    o_e = tl.arange(0, BLOCK_E)  # [BE]
    m_t = o_t < num_tokens
    m_e = o_e < num_experts
    o_src = o_t  # the row whose logits row t routes by
    if PADDING:
        o_src = tl.where(tl.load(p_padding + o_t, mask=m_t, other=0) != 0, 0, o_t)
    b_logits = tl.load(p_logits + o_src[:, None] * stride_lt + o_e[None, :], mask=m_t[:, None] & m_e[None, :],
                       other=float("-inf")).to(tl.float32)  # fmt: skip
    b_logits = tl.where(m_t[:, None], b_logits, 0.0)  # rows past the tokens: finite, never stored
    b_exp = tl.exp(b_logits - tl.max(b_logits, 1)[:, None])
    b_p = tl.where(m_e[None, :], b_exp / tl.sum(b_exp, 1)[:, None], -1.0)  # [BT, BE]; -1 is never chosen
    o_k = tl.arange(0, K_PAD)[None, :]  # [1, K padded to a power of 2]
    b_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    b_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        b_best = tl.max(b_p, 1)  # [BT]
        b_id = tl.min(tl.where(b_p == b_best[:, None], o_e[None, :], BLOCK_E), 1)  # [BT] lowest id on a tie
        b_id = tl.minimum(b_id, num_experts - 1)  # a NaN row matches no expert: an id in range, never past the tables
        b_ids = tl.where(o_k == k, b_id[:, None].to(tl.int64), b_ids)
        b_w = tl.where(o_k == k, b_best[:, None], b_w)
        b_p = tl.where(o_e[None, :] == b_id[:, None], -1.0, b_p)
    if RENORMALIZE:
        b_w = b_w / tl.sum(b_w, 1)[:, None]
    o_out = o_t[:, None] * TOP_K + o_k
    m_out = m_t[:, None] & (o_k < TOP_K)
    tl.store(p_ids + o_out, b_ids, mask=m_out)
    tl.store(p_weights + o_out, b_w, mask=m_out)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool, padding_rows: torch.Tensor | None = None):
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1, "logit rows must be contiguous"
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, BLOCK_T),)
        padding = padding_rows is not None
        _topk_softmax_kernel[grid](logits, padding_rows if padding else logits, ids, weights, num_tokens, num_experts,
                                   logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, PADDING=padding,
                                   K_PAD=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_T,
                                   BLOCK_E=triton.next_power_of_2(num_experts))  # fmt: skip
    return ids, weights


@torch.library.custom_op("rimuru::topk_softmax", mutates_args=(), device_types="cpu")
def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 padding_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return reference.topk_softmax(logits, top_k, renormalize, padding_rows)


@topk_softmax.register_kernel("cuda")
def _topk_softmax_cuda(logits, top_k, renormalize, padding_rows=None):
    return topk_softmax_triton(logits, top_k, renormalize, padding_rows)


@topk_softmax.register_fake
def _topk_softmax_fake(logits, top_k, renormalize, padding_rows=None):
    shape = (logits.shape[0], top_k)
    return (torch.empty(shape, dtype=torch.int64, device=logits.device),
            torch.empty(shape, dtype=torch.float32, device=logits.device))  # fmt: skip
