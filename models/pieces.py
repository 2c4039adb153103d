"""A forward pass in pieces: each MoE layer calls the context's `on_routing` hook between its router and its experts.

The cut is where the expert manager works (copy routed experts in, prefetch the next layer's) before the expert
kernel reads the page table; the hook may hand back work that can wait until the next piece is queued. Eagerly,
`call_routing_hook` runs that work at once; `rimuru.step_graphs` captures each piece between two cuts as a CUDA
graph (its capture hook ends one graph and begins the next) and runs the hook between replays. Either way the model
code is the same, so the two paths compute the same tokens.

    forward():  [embed, attn 0, router 0] | hook 0 | [experts 0, attn 1, router 1] | hook 1 | ...
                ... | hook L-1 | [experts L-1, final norm, LM head] -> logits

Under `torch.compile` the hook is the pass's only graph break: a pass without one traces as a single graph.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch


class RoutingPoint(NamedTuple):
    layer_idx: int
    hidden: torch.Tensor  # [T, D] the router's input
    topk_ids: torch.Tensor  # [T, K] the experts each token is routed to


RoutingHook = Callable[[int, torch.Tensor, torch.Tensor], Callable[[], None] | None]


# NOTE: the hook is host code (expert copies, page-table edits, CUDA graph cuts): a compiled pass breaks here
@torch.compiler.disable
def call_routing_hook(on_routing: RoutingHook, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Run `on_routing(layer_idx, hidden, topk_ids)` and, eagerly, the work it hands back (a prefetch) at once."""
    later = on_routing(layer_idx, hidden, topk_ids)
    if later is not None:
        later()
