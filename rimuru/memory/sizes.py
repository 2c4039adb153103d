"""Page sizes of the pool's tiers, derived once from a model config (docs/architecture.md, The page pool).

Owns the arithmetic that makes the tiers nest: small pages (KV, conv) must divide the expert page, and the huge
page is the least common multiple of the middle-tier sizes (expert and SSM pages). Where a small page does not
divide the expert page, its stride is padded up to the next divisor and the padding is reported, never hidden.
Does not own any memory: `MemoryPool` and `PageAllocator` do.
"""

import math
from dataclasses import dataclass, field

import torch

from rimuru.config import DEFAULT_PAGE_TOKENS
from rimuru.ops.linear_attention import STATE_DTYPE

# An SSM page whose lcm with the expert page exceeds this many middle pages is padded instead (see _ssm_stride).
_MAX_MIDDLE_PAGES_PER_HUGE = 16


@dataclass(frozen=True)
class PageSizes:
    """Bytes of each page kind. `*_stride` = payload + padding; a page id times its stride is its byte offset."""

    dtype: torch.dtype
    expert_page_bytes: int  # one expert matrix: F * D elements
    expert_page_shape: tuple[int, ...]  # (F * D,)
    kv_page_bytes: int  # K and V of page_tokens tokens of one attention layer
    kv_page_shape: tuple[int, ...]  # (2, page_tokens, Hk, Dh)
    kv_page_stride: int
    huge_page_bytes: int
    ssm_page_bytes: int = 0
    ssm_page_shape: tuple[int, ...] = ()
    ssm_page_stride: int = 0
    conv_page_bytes: int = 0
    conv_page_shape: tuple[int, ...] = ()
    conv_page_stride: int = 0
    ssm_dtype: torch.dtype | None = None  # the recurrent state's own dtype (a checkpoint's mamba_ssm_dtype); None: dtype
    notes: tuple[str, ...] = field(default=(), compare=False)  # padding decisions, for the start-up log

    @property
    def page_tokens(self) -> int:
        return self.kv_page_shape[1]

    @property
    def kv_pages_per_expert_page(self) -> int:
        return self.expert_page_bytes // self.kv_page_stride

    @property
    def kv_padding_bytes(self) -> int:
        """Bytes of an expert page split into KV pages that hold no KV (per-page padding plus the tail)."""
        return self.expert_page_bytes - self.kv_pages_per_expert_page * self.kv_page_bytes


def smallest_divisor_at_least(total: int, minimum: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that divides `total` and is >= `minimum`, or `total` itself."""
    if total % alignment:
        raise ValueError(f"page of {total} bytes is not a multiple of the {alignment}-byte element size")
    units, min_units = total // alignment, -(-minimum // alignment)
    best = units
    for d in range(1, math.isqrt(units) + 1):
        if units % d == 0:
            for candidate in (d, units // d):
                if min_units <= candidate < best:
                    best = candidate
    return best * alignment


def _small_stride(name: str, page_bytes: int, expert_page_bytes: int, alignment: int, notes: list[str]) -> int:
    if page_bytes > expert_page_bytes:
        raise ValueError(
            f"a {name} page of {page_bytes} bytes does not fit in an expert page of {expert_page_bytes} bytes; "
            f"use fewer tokens per page"
        )
    stride = smallest_divisor_at_least(expert_page_bytes, page_bytes, alignment)
    if stride != page_bytes:
        notes.append(
            f"{name} page {page_bytes} B padded to {stride} B to divide the expert page of {expert_page_bytes} B "
            f"({expert_page_bytes // stride} per expert page, {expert_page_bytes - (expert_page_bytes // stride) * page_bytes} B padding)"
        )
    return stride


def _ssm_stride(ssm_bytes: int, expert_page_bytes: int, alignment: int, notes: list[str]) -> int:
    """Exact when lcm(expert, ssm) stays small; else padded to a multiple of expert_page / 16 so it does."""
    if math.lcm(expert_page_bytes, ssm_bytes) <= _MAX_MIDDLE_PAGES_PER_HUGE * max(expert_page_bytes, ssm_bytes):
        return ssm_bytes
    unit = expert_page_bytes // _MAX_MIDDLE_PAGES_PER_HUGE
    if unit % alignment or expert_page_bytes % _MAX_MIDDLE_PAGES_PER_HUGE:
        unit = expert_page_bytes
    stride = -(-ssm_bytes // unit) * unit
    notes.append(f"SSM page {ssm_bytes} B padded to {stride} B so that huge pages stay small")
    return stride


def page_sizes(
    expert_page_shape: tuple[int, ...],
    kv_page_shape: tuple[int, ...],
    dtype: torch.dtype,
    ssm_page_shape: tuple[int, ...] = (),
    conv_page_shape: tuple[int, ...] = (),
    ssm_dtype: torch.dtype | None = None,
) -> PageSizes:
    """Sizes of every page kind from element shapes (SSM pages in `ssm_dtype` where given); raises ValueError naming
    the sizes that cannot nest."""
    elem = torch.empty((), dtype=dtype).element_size()
    expert_bytes, kv_bytes = math.prod(expert_page_shape) * elem, math.prod(kv_page_shape) * elem
    if expert_bytes <= 0 or kv_bytes <= 0:
        raise ValueError(f"page sizes must be positive: expert {expert_bytes} B, KV {kv_bytes} B")
    notes: list[str] = []
    kv_stride = _small_stride("KV", kv_bytes, expert_bytes, elem, notes)
    ssm_elem = torch.empty((), dtype=ssm_dtype or dtype).element_size()
    ssm_bytes = math.prod(ssm_page_shape) * ssm_elem if ssm_page_shape else 0
    conv_bytes = math.prod(conv_page_shape) * elem if conv_page_shape else 0
    ssm_stride = _ssm_stride(ssm_bytes, expert_bytes, max(elem, ssm_elem), notes) if ssm_bytes else 0
    conv_stride = _small_stride("conv", conv_bytes, expert_bytes, elem, notes) if conv_bytes else 0
    huge = math.lcm(expert_bytes, ssm_stride) if ssm_stride else expert_bytes
    return PageSizes(
        dtype=dtype,
        expert_page_bytes=expert_bytes,
        expert_page_shape=tuple(expert_page_shape),
        kv_page_bytes=kv_bytes,
        kv_page_shape=tuple(kv_page_shape),
        kv_page_stride=kv_stride,
        huge_page_bytes=huge,
        ssm_page_bytes=ssm_bytes,
        ssm_page_shape=tuple(ssm_page_shape),
        ssm_page_stride=ssm_stride,
        conv_page_bytes=conv_bytes,
        conv_page_shape=tuple(conv_page_shape),
        conv_page_stride=conv_stride,
        ssm_dtype=ssm_dtype,
        notes=tuple(notes),
    )


def fitting_page_tokens(config, wanted: int = DEFAULT_PAGE_TOKENS) -> int:
    """The largest KV page up to `wanted` tokens that an expert page can carry, halving (a power of two stays one);
    ValueError when not even one token's K and V fits. Both pages share the dtype, so elements decide."""
    per_token = 2 * config.num_key_value_heads * _head_dim(config)  # K and V of one token, one layer
    expert_elements = config.moe_intermediate_size * config.hidden_size
    tokens = wanted
    while tokens > 1 and tokens * per_token > expert_elements:
        tokens //= 2
    if tokens * per_token > expert_elements:
        raise ValueError(f"one token's K and V ({per_token} elements) do not fit in an expert page of "
                         f"{expert_elements} elements")  # fmt: skip
    return tokens


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def page_sizes_for_model(config, dtype: torch.dtype, page_tokens: int = DEFAULT_PAGE_TOKENS) -> PageSizes:
    """Expert page = moe_intermediate_size * hidden_size; KV page = 2 * page_tokens * Hk * Dh, one layer.

    `config` is any object with Hugging Face's attribute names (a `ModelConfig`, a transformers config, or a
    namespace); `head_dim` defaults to hidden_size / num_attention_heads.
    """
    expert_shape = (config.moe_intermediate_size * config.hidden_size,)
    kv_shape = (2, page_tokens, config.num_key_value_heads, _head_dim(config))
    if not getattr(config, "linear_layer_ids", None):
        return page_sizes(expert_shape, kv_shape, dtype)
    return page_sizes(expert_shape, kv_shape, dtype, *linear_state_shapes(config), ssm_dtype=STATE_DTYPE)


def linear_state_shapes(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A Gated DeltaNet layer's per-request state: the recurrent state [Hv, dk, dv] (an SSM page, in the dtype the
    delta rule's kernels keep it) and the conv history [2 * Hk * dk + Hv * dv, kernel - 1] (a conv page)."""
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * config.linear_num_key_heads * dk + hv * dv
    return (hv, dk, dv), (channels, config.linear_conv_kernel_dim - 1)
