"""`ExpertManager`: the engine's one handle on the expert path of a round, wiring three parts (docs/architecture.md,
Expert tiers and One round):

- `changes` (`ExpertChanges`): the adjuster's change list, applied around the pass (`begin_step`, `end_step`);
- `loader` (`ExpertLoader`): the copy hook and its loading buffers, and the working page tables;
- `counter` (`RoutingCounter`): the routing of each pass, counted once, for the popularity, direct reads and
  observers.

Here only what the engine and its records call: the pass's page tables and hook (`pass_routing`), the step's
bracket and the statistics. It holds no state of its own beyond the direct-read mode's host experts.
"""

from collections.abc import Callable

import torch

from rimuru.adjuster import ChangeList
from rimuru.expert_changes import ExpertChanges
from rimuru.expert_loader import ExpertLoader
from rimuru.expert_stats import ExpertStats
from rimuru.expert_store import ExpertStore
from rimuru.popularity import ExpertPopularity
from rimuru.routing_counter import RoutingCounter


class ExpertManager:
    def __init__(self, store: ExpertStore, buffer_experts: int, routers: dict[int, torch.Tensor], top_k: int,
                 predict: bool = True, popularity: ExpertPopularity | None = None, direct: bool = False):  # fmt: skip
        self.store = store
        self.direct = direct  # expert_reads="direct": the kernels read host experts in place, no hook waits
        # what the kernels read for an expert at -1 when direct: each layer's pinned host copies
        self.host_experts = {layer: (w.gate, w.up, w.down) for layer, w in store.host.items()} if direct else None
        pinned = all(m.is_pinned() for ms in (self.host_experts or {}).values() for m in ms)
        if direct and store.page_tables.is_cuda and not pinned:
            raise ValueError("expert_reads='direct' needs the experts in pinned host memory (the GPU reads them there)")
        self.stats = ExpertStats()
        self.counter = RoutingCounter(store, popularity, direct)
        self.changes = ExpertChanges(store, self.stats)
        self.loader = ExpertLoader(store, self.changes, self.counter, self.stats, buffer_experts, routers, top_k,
                                   predict)  # fmt: skip

    @property
    def is_active(self) -> bool:
        """Whether this pass needs the copy hook: some expert is on the host or on its way in (never with direct
        reads: additions are then published between passes, and a routed host expert is read where it is)."""
        return not self.direct and bool(self.store.num_offloaded or self.changes.pending_add)

    def stats_dict(self) -> dict:
        """The counters, with `direct_reads`."""
        return self.stats.as_dict() | {"direct_reads": self.direct_reads()}

    def direct_reads(self) -> int:
        """(layer, expert) reads of a routed host expert in place so far (`RoutingCounter.direct_reads`)."""
        return self.counter.direct_reads()

    def pass_routing(self, fixed_tables: bool = False, counted: bool = False) -> tuple[torch.Tensor, Callable | None]:
        """The expert page tables [L, E, 3] the kernels read this pass, and the routing hook to run. With every
        expert resident that is the resident table and at most the counting hook. `fixed_tables` (CUDA graphs,
        whose kernels read one fixed tensor) always gives the loader's `working_tables`, refreshed here when no hook
        will. `counted`: the pass counts its own routing (`RoutingCounter.count_pass`, inside the step graphs)."""
        self.counter.begin_pass(counted)
        if self.is_active:
            return self.loader.working_tables, self.loader.on_routing
        if fixed_tables:
            self.loader.refresh_working_tables()
            return self.loader.working_tables, self.counter.hook
        return self.store.page_tables, self.counter.hook

    def begin_step(self, changes: ChangeList) -> None:
        """Before the pass: start the change list's additions (`ExpertChanges.begin_step`)."""
        self.changes.begin_step(changes)

    def end_step(self) -> None:
        """After the pass: count its routing while the tables are still the pass's, then apply the changes."""
        self.counter.count_kept()
        self.changes.end_step()
