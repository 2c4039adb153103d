"""Rimuru's ops: Triton kernels over pool pages registered as `torch.ops.rimuru.*`, each with a torch reference
(`rimuru.ops.reference`) that is also its CPU kernel.

The model code calls only the functions exported here. They dispatch through `torch.library`: CPU tensors run
the references, CUDA tensors the Triton kernels, and `torch.compile(fullgraph=True)` traces them through their
fake implementations.
"""

import functools
import os

import torch

import rimuru.ops.activations  # noqa: F401  (registers rimuru::silu_and_mul and sigmoid_gated_add)
import rimuru.ops.linear_attention  # noqa: F401  (registers rimuru::gated_delta_* and causal_conv1d_*)
import rimuru.ops.paged_attention  # noqa: F401  (registers rimuru::paged_attention)
import rimuru.ops.paged_moe  # noqa: F401  (registers rimuru::paged_moe)
import rimuru.ops.rms_norm  # noqa: F401  (registers rimuru::rms_norm and add_rms_norm)
import rimuru.ops.rope_write_kv  # noqa: F401  (registers rimuru::rope_write_kv)
import rimuru.ops.topk_softmax  # noqa: F401  (registers rimuru::topk_softmax)
import rimuru.ops.write_kv  # noqa: F401  (registers rimuru::write_kv)
from rimuru.ops import reference

# RIMURU_INDUCTOR_FUSIONS=1: under torch.compile the elementwise ops (norms, RoPE, activations, the router's top-k)
# trace as their torch references, which inductor fuses with their neighbours, in place of Rimuru's kernels
INDUCTOR_FUSIONS = os.environ.get("RIMURU_INDUCTOR_FUSIONS") == "1"


def _or_reference(reference_fn):
    """The decorated op, or `reference_fn` where inductor fuses (INDUCTOR_FUSIONS, while compiling)."""

    def decorate(op_fn):
        @functools.wraps(op_fn)
        def call(*args):
            fused = INDUCTOR_FUSIONS and torch.compiler.is_compiling()
            return (reference_fn if fused else op_fn)(*args)

        return call

    return decorate


def paged_moe(
    hidden: torch.Tensor,  # [T, D]
    expert_view: torch.Tensor,  # [P, F * D]
    page_table: torch.Tensor,  # [E, 3] int32: gate, up, down page ids
    topk_ids: torch.Tensor,  # [T, K] int
    topk_weights: torch.Tensor,  # [T, K] float32
    num_features: int,  # F
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # pinned gate, up [E, F, D], down [E, D, F]
) -> torch.Tensor:  # [T, D]
    """Routed-expert MLP over expert pages, and over `host` copies for experts whose pages are -1; see
    `rimuru.ops.reference.paged_moe`."""
    return torch.ops.rimuru.paged_moe(hidden, expert_view, page_table, topk_ids, topk_weights, num_features,
                                      *(host or (None, None, None)))  # fmt: skip


@_or_reference(reference.rms_norm)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x [..., N], weight [N]
    """RMSNorm over the last dimension in one kernel; see `rimuru.ops.reference.rms_norm`."""
    return torch.ops.rimuru.rms_norm(x, weight, eps)


@_or_reference(reference.add_rms_norm)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):  # [T, N] each
    """(RMSNorm of x + residual, x + residual) in one kernel; see `rimuru.ops.reference.add_rms_norm`."""
    return torch.ops.rimuru.add_rms_norm(x, residual, weight, eps)


@_or_reference(reference.silu_and_mul)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
    """silu(gate) * up of a stacked gate/up projection in one kernel; see `rimuru.ops.reference.silu_and_mul`."""
    return torch.ops.rimuru.silu_and_mul(x)


@_or_reference(reference.sigmoid_gated_add)
def sigmoid_gated_add(base: torch.Tensor, gate_logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate_logits) * x in one kernel; see `rimuru.ops.reference.sigmoid_gated_add`."""
    return torch.ops.rimuru.sigmoid_gated_add(base, gate_logits, x)


@_or_reference(reference.topk_softmax)
def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, padding_rows: torch.Tensor | None = None):
    """Router top-k ids [T, K] int64 and softmax weights [T, K] fp32 in one kernel, `padding_rows` routed as row 0;
    see `rimuru.ops.reference.topk_softmax`."""  # logits [T, E] float32
    return torch.ops.rimuru.topk_softmax(logits, top_k, renormalize, padding_rows)


def write_kv(
    key: torch.Tensor,  # [T, Hk, Dh]
    value: torch.Tensor,  # [T, Hk, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], mutated
    slot_mapping: torch.Tensor,  # [T] int: page_id * S + offset in page; < 0 skips the token
) -> None:
    """Store each token's K and V at its slot, in place; see `rimuru.ops.reference.write_kv`."""
    torch.ops.rimuru.write_kv(key, value, kv_view, slot_mapping)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hk) * Dh], the fused projection's rows
    q_weight: torch.Tensor | None,  # [Dh] q's per-head RMSNorm weight, or None where the family has no q/k norm
    k_weight: torch.Tensor | None,  # [Dh]
    eps: float,
    cos: torch.Tensor,  # [T, Dh]
    sin: torch.Tensor,
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh], mutated
    slot_mapping: torch.Tensor,  # [T]
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # [T, Hq, Dh]
    """q and k normalised per head and rotated, K and V stored at their slots, in one kernel; returns q. See
    `rimuru.ops.reference.rope_write_kv`."""
    if INDUCTOR_FUSIONS and torch.compiler.is_compiling():  # inductor fuses the norms and RoPE; the write stays ours
        q, k, v = reference.attention_heads(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads,
                                            kv_view.shape[-1])  # fmt: skip
        write_kv(k, v, kv_view, slot_mapping)
        return q.contiguous()
    return torch.ops.rimuru.rope_write_kv(qkv, q_weight, k_weight, eps, cos, sin, kv_view, slot_mapping, num_q_heads,
                                          num_kv_heads)  # fmt: skip


def paged_attention(
    query: torch.Tensor,  # [T, Hq, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh]
    page_table: torch.Tensor,  # [B, max pages] int32
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
) -> torch.Tensor:  # [T, Hq, Dh]
    """Causal GQA attention over K/V pages; see `rimuru.ops.reference.paged_attention`."""
    return torch.ops.rimuru.paged_attention(query, kv_view, page_table, seq_lens, query_start_loc, scale)


__all__ = ["add_rms_norm", "paged_attention", "paged_moe", "rms_norm", "rope_write_kv", "sigmoid_gated_add",
           "silu_and_mul", "topk_softmax", "write_kv"]


def gated_delta_step(q, k, v, g, beta, ssm_view: torch.Tensor, state_ids: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule a request, its state updated in place in `ssm_view[state_ids]`; see
    `rimuru.ops.reference.gated_delta_step`."""
    return torch.ops.rimuru.gated_delta_step(q, k, v, g, beta, ssm_view, state_ids)


def causal_conv1d_step(x, conv_view: torch.Tensor, state_ids: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of each request's next input, its history shifted in place; see
    `rimuru.ops.reference.causal_conv1d_step`."""
    return torch.ops.rimuru.causal_conv1d_step(x, conv_view, state_ids, weight, bias)


def gated_delta_prefill(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues) -> torch.Tensor:
    """The gated delta rule over a packed batch of prompt chunks, each request's state carried through its page;
    see `rimuru.ops.reference.gated_delta_prefill`."""
    return torch.ops.rimuru.gated_delta_prefill(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues)


def causal_conv1d_prefill(x, conv_view, state_ids, query_start_loc, continues, weight, bias=None) -> torch.Tensor:
    """The causal conv over a packed batch of prompt chunks; see `rimuru.ops.reference.causal_conv1d_prefill`."""
    return torch.ops.rimuru.causal_conv1d_prefill(x, conv_view, state_ids, query_start_loc, continues, weight, bias)
