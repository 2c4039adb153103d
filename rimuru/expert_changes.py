"""`ExpertChanges`: the adjuster's `ChangeList` applied to the expert store around one pass (docs/architecture.md,
The adjuster: When the changes apply).

`begin_step` reserves pages for added experts and starts their copies on the side stream. `publish_layer` points a
layer's page tables (device and host mirror, through `ExpertStore.publish`) at its pending additions once their
copies are done: the copy hook calls it before the layer's kernel. `end_step` publishes what is still pending and
applies the evictions, so an evicted expert stays readable for the whole pass and its pages serve the next round;
a swap evicts one expert there and copies its replacement into the freed pages, published like an addition once
the copy is done. It does not count routings nor copy routed host experts in (`ExpertLoader`).
"""

from rimuru.adjuster import ChangeList
from rimuru.expert_stats import ExpertStats
from rimuru.expert_store import ExpertStore


class ExpertChanges:
    def __init__(self, store: ExpertStore, stats: ExpertStats):
        self.store, self.copier, self.stats = store, store.copier, stats
        self.pending_add: dict[tuple[int, int], tuple[list[int], object]] = {}  # (layer, expert) -> (pages, event)
        self.pending_evict: list[tuple[int, int]] = []
        self.pending_swap: list[tuple[int, int, int]] = []

    def begin_step(self, changes: ChangeList) -> None:
        """Reserve and start copying added experts; remember evictions and swaps for `end_step`."""
        # the pages' last KV writer may be a pass still queued (async scheduling: a request freed them under it)
        last_writer = self.copier.compute_mark() if changes.add else None
        for layer, expert in changes.add:
            page_ids = self.store.reserve(layer, expert)
            if page_ids is None:
                break
            event = self.store.copy_in(layer, expert, page_ids, after=last_writer)
            self.pending_add[(layer, expert)] = (page_ids, event)
        self.pending_evict = list(changes.evict)
        self.pending_swap = list(changes.swap)

    def publish_layer(self, layer: int) -> None:
        """Publish `layer`'s pending additions (the compute stream waits for their copies first)."""
        for key in [k for k in self.pending_add if k[0] == layer]:
            self._publish(*key)

    def end_step(self) -> None:
        """After the pass (its routing counted): publish what is still pending, then evict (their pages serve the
        next round), then swap: each swapped-in expert is copied into pages just freed, after the pass, and
        published during the next."""
        for key in list(self.pending_add):
            self._publish(*key)
        for layer, expert in self.pending_evict:
            self.store.evict(layer, expert)
        self.stats.evictions += len(self.pending_evict)
        self.pending_evict = []
        for swap in self.pending_swap:
            self._swap(*swap)
        self.pending_swap = []
        self.stats.bytes_copied = self.copier.bytes_copied

    def _swap(self, layer: int, expert_out: int, expert_in: int) -> None:
        self.store.evict(layer, expert_out)
        page_ids = self.store.reserve(layer, expert_in)  # NOTE: never None: three expert pages were just freed
        last_reader = self.copier.compute_mark()  # the pass that read the evicted expert's pages
        event = self.store.copy_in(layer, expert_in, page_ids, after=last_reader)
        self.pending_add[(layer, expert_in)] = (page_ids, event)
        self.stats.swaps += 1

    def _publish(self, layer: int, expert: int) -> None:
        page_ids, event = self.pending_add.pop((layer, expert))
        self.copier.wait(event)  # NOTE: the table points at the pages only after their copy
        self.store.publish(layer, expert, page_ids)
        self.stats.additions += 1
