"""`ExpertStats`: the running counters of expert traffic that `ExpertChanges` and `ExpertLoader` add to.

One instance is shared by both, so a record reads every counter in one `as_dict` (the engine adds `direct_reads`
from the `RoutingCounter`). It holds numbers only and decides nothing.
"""

from dataclasses import dataclass


@dataclass
class ExpertStats:
    evictions: int = 0
    additions: int = 0  # published additions, swapped-in experts included
    swaps: int = 0  # resident experts replaced by hotter host ones (their pages reused)
    prefetched: int = 0  # experts copied ahead on a prediction
    prefetch_hits: int = 0  # routed host experts found prefetched
    prefetch_misses: int = 0  # routed host experts copied on demand
    bytes_copied: int = 0
    hook_seconds: float = 0.0  # host time inside on_routing and its prefetch: waiting for routing results, copies
    routing_wait_seconds: float = 0.0  # of it, waiting for the GPU to finish the layer up to its router
    prefetch_seconds: float = 0.0  # of it, issuing the next layer's prefetch copies (after the next piece is queued)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
