"""The one thing a model reads besides its weights: what the runner prepared for this forward pass.

A model never sees the scheduler, the allocator or the expert store; the `ModelRunner` fills a `ForwardContext`
each step. Shape letters: T tokens this step, B requests, L decoder layers, E experts, P pages.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    query_start_loc: torch.Tensor  # [B + 1] int32, where each request's tokens start in the batch
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache per request after this step
    kv_page_tables: torch.Tensor  # [L, B, max pages] int32, KV page ids per layer and request (-1 unused)
    slot_mappings: torch.Tensor  # [L, T] int64, page_id * page_tokens + offset for each new token per layer
    expert_page_tables: torch.Tensor  # [L, E, 3] int32, (gate, up, down) page ids per layer (-1: not in the pool)
    kv_view: torch.Tensor  # [P, 2, page_tokens, Hk, Dh] the pool seen as KV pages
    expert_view: torch.Tensor  # [P, F * D] the pool seen as expert pages
    logits_indices: torch.Tensor  # [B'] int64, tokens whose logits are wanted (last token of finished prefills)
    # Called by each MoE layer after routing, before the expert kernel: (layer_idx, router_input [T, D],
    # topk_ids [T, K]). The expert manager uses it to prefetch and to copy in routed experts that are not in
    # the pool, updating `expert_page_tables` in place; it may return work for before the next routing
    # (`rimuru.models.pieces.RoutingHook`). None when every expert is resident.
    on_routing: Callable[[int, torch.Tensor, torch.Tensor], Callable[[], None] | None] | None = None
    # MoE layer -> its pinned host copies (gate [E, F, D], up [E, F, D], down [E, D, F]): the expert kernel reads an
    # expert whose page-table entry is -1 there, over the host link (expert_reads="direct"). None: never.
    host_experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # [T] bool, the padding rows of a CUDA graph's batch: they route like row 0, so they touch no expert a real
    # token does not. None: no padding.
    padding_rows: torch.Tensor | None = None
    # Hybrid models: the pool seen as SSM pages [P, Hv, Dk, Dv] (or those bytes in the pool's dtype, which the ops
    # read as the state's: `MemoryPool.ssm_view_in_pool_dtype`) and conv pages [P, C, W - 1], each linear layer's
    # state page per request ([L_linear, B], in `ModelConfig.linear_layer_ids` order), and whether a request's
    # state already holds earlier tokens ([B] bool; False: its first prompt chunk starts from zero). None: no
    # linear-attention layers.
    ssm_view: torch.Tensor | None = None
    conv_view: torch.Tensor | None = None
    ssm_state_ids: torch.Tensor | None = None
    conv_state_ids: torch.Tensor | None = None
    state_continues: torch.Tensor | None = None
    # every request brings one token and continues its state, known on the host (a captured or compiled pass
    # branches on no device value): the linear layers take their decode kernels. False: their prompt kernels, which
    # also take decodes.
    decode_only: bool = False
