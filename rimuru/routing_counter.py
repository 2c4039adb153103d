"""`RoutingCounter`: the one place a pass's expert routing is counted (docs/architecture.md, Expert tiers).

Every consumer of the routing reads from here: the online `ExpertPopularity` (tokens a (layer, expert)), the host
experts read in place with direct reads (`direct_reads`), and the `observers`. A pass is counted on the device, once,
with no host sync, through one sink (`_record`), by one of two feeds:
  - a pass the step graphs run counts itself in its last graph (`count_pass`, replayed with the pass);
  - an eager pass's hooks only keep each layer's top-k ids (`see`) and `count_kept` counts them all after the pass
    in a few kernels, not a few kernels a layer.
`tally` is the scatter-add every routing count is made of, the copy hook's per-layer counts included. It does not
decide where experts live, nor copy them.
"""

from collections.abc import Callable

import torch

from rimuru.expert_store import ExpertStore
from rimuru.lagged_read import LaggedRead
from rimuru.popularity import ExpertPopularity


class RoutingCounter:
    def __init__(self, store: ExpertStore, popularity: ExpertPopularity | None, direct: bool):
        self.store, self.popularity, self.direct = store, popularity, direct
        self.moe_layers = store.layer_ids
        if popularity is not None and popularity.layer_ids != self.moe_layers:
            raise ValueError(f"the popularity covers layers {popularity.layer_ids}, the model's MoE layers are "
                             f"{self.moe_layers}")  # fmt: skip
        self.ordinal = {layer: i for i, layer in enumerate(self.moe_layers)}
        device = store.page_tables.device
        self._direct_reads = torch.zeros((), dtype=torch.int64, device=device)
        self._pass_ids: list[tuple[int, torch.Tensor]] = []  # (layer, topk_ids [T, K]) routed this pass, uncounted
        self._counted_in_pass = False  # this pass counts its own routing (`count_pass`): the hooks keep no ids
        self._moe_index = torch.tensor(self.moe_layers, dtype=torch.int64, device=device)  # [L] page-table rows
        self._layer_offsets = self._moe_index.new_tensor(range(len(self.moe_layers))).view(-1, 1, 1) * store.num_experts
        self._pass_counts = torch.zeros(len(self.moe_layers), store.num_experts, dtype=torch.int64, device=device)
        self._ones = torch.ones(0, dtype=torch.int64, device=device)  # grown to the largest batch
        # called with (layer, router input [T, D], topk_ids [T, K]) at every MoE routing of every pass, eager or
        # CUDA graph, with the batch's rows only (rimuru.profiler)
        self.observers: list[Callable[[int, torch.Tensor, torch.Tensor], None]] = []

    @property
    def counts_routing(self) -> bool:
        """Whether passes are counted: for the online popularity, or the host experts read in place."""
        return self.popularity is not None or self.direct

    def direct_reads(self) -> int:
        """(layer, expert) reads of a routed host expert in place so far (counted on the device; reading the count
        waits for the passes queued)."""
        return int(self._direct_reads)

    def lagged_direct_reads(self) -> Callable[[], int]:
        """A reader of `direct_reads` as of its call before, never waiting for a pass (`LaggedRead`; its first
        call reads now): for a reader that runs while the next pass is queued (the cost rule under async
        scheduling). One a reader: another's copy may sit behind a pass still running."""
        behind = LaggedRead(self._direct_reads)

        def read() -> int:
            landed = behind.take()
            return self.direct_reads() if landed is None else int(landed)

        return read

    def begin_pass(self, counted: bool) -> None:
        """`counted`: the pass counts its own routing (`count_pass`, inside the step graphs), so no hook keeps ids."""
        self._counted_in_pass = counted

    @property
    def hook(self) -> Callable | None:
        """The routing hook of a pass with every expert resident: counting only, or None when nothing counts."""
        uncounted = self.counts_routing and not self._counted_in_pass
        counts = uncounted and (self.popularity is not None or self.store.num_offloaded)
        return self.see if counts or self.observers else None

    def see(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Show a layer's routing to the observers and keep its ids for `count_kept` (no kernel here)."""
        for observe in self.observers:
            observe(layer, hidden, topk_ids)
        if self.counts_routing:
            self._keep_ids(layer, topk_ids)

    def _keep_ids(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Keep a layer's ids for `count_kept`; a caller that runs passes without `count_kept` (a benchmark of the
        hook) gets them counted every few passes instead of kept without end. A pass that counts itself keeps none."""
        if self._counted_in_pass:
            return
        self._pass_ids.append((layer, topk_ids))
        if len(self._pass_ids) > 4 * len(self.moe_layers):
            self.count_kept()

    def count_kept(self) -> None:
        """Count the routings the hooks kept this pass: tokens a (layer, expert) into the online popularity, and with
        direct reads each routed host expert once a layer (call it before the pass's additions are published and
        its evictions applied: the tables are still the pass's). About ten kernels a pass, wherever it ran."""
        kept, self._pass_ids = self._pass_ids, []
        if not kept:
            return
        self._record(self._routed_counts(kept), self.store.page_tables)

    def count_pass(self, topk_ids: torch.Tensor, real_rows: torch.Tensor, tables: torch.Tensor) -> None:
        """Count a whole pass's routing on the device with no host work that depends on the step: `topk_ids`
        [L, T, K] (every MoE layer, padded rows included), `real_rows` [T] bool (False on padding), `tables` the
        page tables the pass's kernels read. The step graphs capture this at the end of each pass (about ten kernels
        replayed, not launched from the host: docs/benchmarks/paper-scenario.md) and run it after an uncaptured one."""
        weights = real_rows.view(1, -1, 1).expand_as(topk_ids).reshape(-1).to(torch.int64)
        counts = self._pass_counts.zero_()
        counts.view(-1).index_add_(0, (topk_ids + self._layer_offsets).reshape(-1), weights)
        self._record(counts, tables)

    def _record(self, counts: torch.Tensor, tables: torch.Tensor) -> None:
        """A pass's [L, E] routed tokens into the online popularity, and with direct reads each routed host expert
        (-1 in the pass's `tables`) as one read."""
        if self.popularity is not None:
            self.popularity.record_all(counts)
        if self.direct:
            on_host = tables.index_select(0, self._moe_index)[:, :, 2] < 0  # [L, E]
            self._direct_reads += (on_host & (counts > 0)).sum()

    def _routed_counts(self, kept: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """[L, E] tokens routed to each (MoE layer, expert) in `kept`: one scatter-add over the stacked ids when
        every MoE layer is there once, in order (a whole pass), else one a layer."""
        counts = self._pass_counts.zero_()
        layers = [layer for layer, _ in kept]
        if layers == self.moe_layers and len({ids.shape for _, ids in kept}) == 1:
            flat = (torch.stack([ids for _, ids in kept]) + self._layer_offsets).flatten()  # [L T K] into [L E]
            self.tally(counts.view(-1), flat)
            return counts
        for layer, ids in kept:
            self.tally(counts[self.ordinal[layer]], ids.flatten())
        return counts

    def tally(self, counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Add one to `counts` (int64 on the device) at each of the flat `ids`; returns `counts`. No host sync
        (`torch.bincount` would wait to size its output)."""
        return counts.index_add_(0, ids, self._ones_for(ids.numel()))

    def _ones_for(self, n: int) -> torch.Tensor:
        """n ones (int64) on the device, a view of one buffer grown to the largest batch seen."""
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int64, device=self._ones.device)
        return self._ones[:n]
