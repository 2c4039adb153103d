"""A forward pass in pieces: the model's `steps` generators pause after each MoE layer's router.

The pause is where the expert manager works (copy routed experts in, prefetch the next layer's) before the expert
kernel reads the page table; the hook may hand back work that can wait until the next piece is queued.
`run_pieces` drives a pass eagerly, calling the context's `on_routing` hook at each pause; `rimuru.step_graphs`
captures each piece between two pauses as a CUDA graph and runs the hook between replays. Either way the model code
is the same, so the two paths compute the same tokens.

    steps():  [embed, attn 0, router 0] | pause 0 | [experts 0, attn 1, router 1] | pause 1 | ...
              ... | pause L-1 | [experts L-1, final norm, LM head] -> logits
"""

from collections.abc import Callable, Generator
from typing import NamedTuple

import torch


class RoutingPoint(NamedTuple):
    layer_idx: int
    hidden: torch.Tensor  # [T, D] the router's input
    topk_ids: torch.Tensor  # [T, K] the experts each token is routed to


Pieces = Generator[RoutingPoint, None, torch.Tensor]  # yields at each routing, returns the pass's output


RoutingHook = Callable[[int, torch.Tensor, torch.Tensor], Callable[[], None] | None]


def run_pieces(pieces: Pieces, on_routing: RoutingHook | None) -> torch.Tensor:
    """Run every piece of a pass, calling `on_routing(layer_idx, hidden, topk_ids)` at each pause. A hook may return
    work that only has to be done before the next pause (a prefetch); eagerly, that runs at once."""
    while True:
        try:
            point = next(pieces)
        except StopIteration as done:
            return done.value
        if on_routing is not None and (later := on_routing(*point)) is not None:
            later()
