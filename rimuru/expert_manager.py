"""`ExpertManager`: the GPU side of the change list and the per-layer expert path of one forward pass
(docs/architecture.md, Expert tiers and One round).

Between passes: `begin_step` reserves pages for added experts and starts their copies on the side stream;
`end_step` publishes additions whose copies have not been published yet and applies evictions, so an evicted
expert stays readable for the whole pass and its pages serve the next round; a swap evicts one expert there and
copies its replacement into the freed pages, published like an addition once the copy is done.

Inside a pass, `on_routing` runs before each MoE layer's kernel:
  1. the layer's working page table = the resident table, plus finished additions (event wait first);
  2. routed experts on the host: prefetched ones are hits, the rest are copied now into a loading buffer (misses);
  3. prediction for the next MoE layer (its router on this layer's input, the Fate idea): its offloaded experts,
     ranked by predicted tokens, are prefetched into the other buffer on the side stream. The hook returns that
     prefetch for its caller to run: under CUDA graphs after the next piece is queued, so the GPU computes while
     the host issues the copies.
The two buffers, each `buffer_experts` experts x 3 pages inside the pool, alternate by MoE layer ordinal.

With an `ExpertPopularity` or direct reads, the routing is also counted on the device, once a pass, with no host
sync: the online popularity's routings and the host experts read in place. A pass the step graphs run counts itself
in its last graph (`count_pass`, replayed with the pass: no kernel launched from the host). An eager pass's hook
only keeps each layer's top-k ids (`count_routing`, the whole hook when nothing needs copying) and `end_step`
counts them all in a few kernels (`_count_kept_ids`), not a few kernels a layer. `observers` see every routing too.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rimuru.adjuster import ChangeList
from rimuru.expert_store import ExpertStore
from rimuru.memory import EXPERT, PAGES_PER_EXPERT
from rimuru.popularity import ExpertPopularity


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


@dataclass
class _Buffer:
    slots: list[list[int]]  # slot -> the three page ids
    layer: int | None = None  # the MoE layer whose experts the slots hold now
    experts: dict[int, int] = field(default_factory=dict)  # expert -> slot
    ready: object = None  # event: prefetch copies done


class ExpertManager:
    def __init__(self, store: ExpertStore, buffer_experts: int, routers: dict[int, torch.Tensor], top_k: int,
                 predict: bool = True, popularity: ExpertPopularity | None = None, direct: bool = False):  # fmt: skip
        self.store, self.copier = store, store.copier
        self.direct = direct  # expert_reads="direct": the kernels read host experts in place, no hook waits
        # what the kernels read for an expert at -1 when direct: each layer's pinned host copies
        self.host_experts = {layer: (w.gate, w.up, w.down) for layer, w in store.host.items()} if direct else None
        pinned = all(m.is_pinned() for ms in (self.host_experts or {}).values() for m in ms)
        if direct and store.page_tables.is_cuda and not pinned:
            raise ValueError("expert_reads='direct' needs the experts in pinned host memory (the GPU reads them there)")
        self._direct_reads = torch.zeros((), dtype=torch.int64, device=store.page_tables.device)
        self.popularity = popularity
        self.routers, self.top_k = routers, top_k  # MoE layer -> router weight [E, D]; experts per token
        self.predict = predict
        self.moe_layers = store.layer_ids
        self.next_layer = dict(zip(self.moe_layers, self.moe_layers[1:]))
        self.ordinal = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.buffers = [self._reserve_buffer(i, buffer_experts) for i in range(2)] if buffer_experts else []
        self.working_tables = store.page_tables.clone()  # [L, E, 3] what the kernels read this pass
        # per layer, the store's table version its working row equals; None while the row points at loading buffers
        self._row_versions: list[int | None] = list(store.versions)
        self._counts = torch.zeros(2 * store.num_experts, dtype=torch.int64, device=store.page_tables.device)
        if popularity is not None and popularity.layer_ids != self.moe_layers:
            raise ValueError(f"the popularity covers layers {popularity.layer_ids}, the model's MoE layers are "
                             f"{self.moe_layers}")
        self._pass_ids: list[tuple[int, torch.Tensor]] = []  # (layer, topk_ids [T, K]) routed this pass, uncounted
        self._counted_in_pass = False  # this pass counts its own routing (`count_pass`): the hooks keep no ids
        device = store.page_tables.device
        self._moe_index = torch.tensor(self.moe_layers, dtype=torch.int64, device=device)  # [L] page-table rows
        self._layer_offsets = self._moe_index.new_tensor(range(len(self.moe_layers))).view(-1, 1, 1) * store.num_experts
        self._pass_counts = torch.zeros(len(self.moe_layers), store.num_experts, dtype=torch.int64, device=device)
        self._ones = torch.ones(0, dtype=torch.int64, device=store.page_tables.device)  # grown to the largest batch
        # a layer's working row written from the host (pinned on a GPU: a pageable copy would make the host wait for
        # everything queued on the stream, the miss copies included)
        on_gpu = store.page_tables.is_cuda
        self._staging = torch.empty(store.host_tables.shape[1:], dtype=torch.int32, pin_memory=on_gpu)  # [E, 3]
        self.pending_add: dict[tuple[int, int], tuple[list[int], object]] = {}  # (layer, expert) -> (pages, event)
        self.pending_evict: list[tuple[int, int]] = []
        self.pending_swap: list[tuple[int, int, int]] = []
        self.stats = ExpertStats()
        # called with (layer, router input [T, D], topk_ids [T, K]) at every MoE routing of every pass, eager or
        # CUDA graph, with the batch's rows only (rimuru.profiler)
        self.observers: list[Callable[[int, torch.Tensor, torch.Tensor], None]] = []

    def _reserve_buffer(self, index: int, num_experts: int) -> _Buffer:
        page_ids = self.store.allocator.allocate(("loading-buffer", index), num_experts * PAGES_PER_EXPERT, EXPERT)
        if page_ids is None:
            raise ValueError(f"the pool cannot hold two loading buffers of {num_experts} experts")
        return _Buffer([page_ids[i : i + PAGES_PER_EXPERT] for i in range(0, len(page_ids), PAGES_PER_EXPERT)])

    @property
    def is_active(self) -> bool:
        """Whether this pass needs the routing hook: some expert is on the host or on its way in (never with direct
        reads: additions are then published between passes, and a routed host expert is read where it is)."""
        return not self.direct and bool(self.store.num_offloaded or self.pending_add)

    def stats_dict(self) -> dict:
        """The counters, with `direct_reads`."""
        return self.stats.as_dict() | {"direct_reads": self.direct_reads()}

    def direct_reads(self) -> int:
        """(layer, expert) reads of a routed host expert in place so far (counted on the device; reading the count
        waits for the GPU)."""
        return int(self._direct_reads)

    def pass_routing(self, fixed_tables: bool = False, counted: bool = False) -> tuple[torch.Tensor, Callable | None]:
        """The expert page tables [L, E, 3] the kernels read this pass, and the routing hook to run. With every
        expert resident that is the resident table and at most the counting hook. `fixed_tables` (CUDA graphs,
        whose kernels read one fixed tensor) always gives `working_tables`, refreshed here when no hook will.
        `counted`: the pass counts its own routing (`count_pass`, inside the step graphs), so no hook keeps ids."""
        self._counted_in_pass = counted
        if self.is_active:
            return self.working_tables, self.on_routing
        if fixed_tables:
            self.working_tables.copy_(self.store.page_tables)
            self._row_versions = list(self.store.versions)
            return self.working_tables, self.counting_hook
        return self.store.page_tables, self.counting_hook

    @property
    def counting_hook(self):
        """The routing hook of a pass with every expert resident: counting only, or None when nothing counts."""
        uncounted = self.counts_routing and not self._counted_in_pass
        counts = uncounted and (self.popularity is not None or self.store.num_offloaded)
        return self.count_routing if counts or self.observers else None

    @property
    def counts_routing(self) -> bool:
        """Whether passes are counted: for the online popularity, or the host experts read in place."""
        return self.popularity is not None or self.direct

    def count_routing(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Keep the layer's ids for `_count_kept_ids` (no kernel here) and show the routing to the observers."""
        if self.counts_routing:
            self._keep_ids(layer, topk_ids)
        for observe in self.observers:
            observe(layer, hidden, topk_ids)

    def _keep_ids(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Keep a layer's ids for `_count_kept_ids`; a caller that runs passes without `end_step` (a benchmark of
        the hook) gets them counted every few passes instead of kept without end. A pass that counts itself keeps
        none."""
        if self._counted_in_pass:
            return
        self._pass_ids.append((layer, topk_ids))
        if len(self._pass_ids) > 4 * len(self.moe_layers):
            self._count_kept_ids()

    def _count_kept_ids(self) -> None:
        """Count the routings the hooks kept this pass: tokens a (layer, expert) into the online popularity, and with
        direct reads each routed host expert once a layer (the tables are still the pass's: additions are published
        and evictions applied after this). About ten kernels a pass, wherever it ran (eager or graph pieces)."""
        kept, self._pass_ids = self._pass_ids, []
        if not kept:
            return
        self._record(self._routed_counts(kept), self.store.page_tables)

    def count_pass(self, topk_ids: torch.Tensor, real_rows: torch.Tensor) -> None:
        """Count a whole pass's routing on the device with no host work that depends on the step: `topk_ids`
        [L, T, K] (every MoE layer, padded rows included), `real_rows` [T] bool (False on padding). The step graphs
        capture this at the end of each pass (about ten kernels replayed, not launched from the host: 0.44 ms of
        host time a step on the H200's host for Qwen1.5-MoE) and run it after an uncaptured one. Reads
        `working_tables`, which the graphs' kernels read."""
        weights = real_rows.view(1, -1, 1).expand_as(topk_ids).reshape(-1).to(torch.int64)
        counts = self._pass_counts.zero_()
        counts.view(-1).index_add_(0, (topk_ids + self._layer_offsets).reshape(-1), weights)
        self._record(counts, self.working_tables)

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
            counts.view(-1).index_add_(0, flat, self._ones_for(flat.numel()))
            return counts
        for layer, ids in kept:
            flat = ids.flatten()
            counts[self.ordinal[layer]].index_add_(0, flat, self._ones_for(flat.numel()))
        return counts

    # ---- between passes ----------------------------------------------------------------------------------------

    def begin_step(self, changes: ChangeList) -> None:
        """Reserve and start copying added experts; remember evictions for `end_step`."""
        for layer, expert in changes.add:
            page_ids = self.store.reserve(layer, expert)
            if page_ids is None:
                break
            event = self.copier.copy(page_ids, self.store.host_rows(layer, expert))
            self.pending_add[(layer, expert)] = (page_ids, event)
        self.pending_evict = list(changes.evict)
        self.pending_swap = list(changes.swap)

    def end_step(self) -> None:
        """After the pass: count its routing, publish what is still pending, then evict (their pages serve the next
        round), then swap: each swapped-in expert is copied into pages just freed, after the pass, and published
        during the next."""
        self._count_kept_ids()
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
        event = self.copier.copy(page_ids, self.store.host_rows(layer, expert_in), after=last_reader)
        self.pending_add[(layer, expert_in)] = (page_ids, event)
        self.stats.swaps += 1

    def _publish(self, layer: int, expert: int) -> None:
        page_ids, event = self.pending_add.pop((layer, expert))
        self.copier.wait(event)  # NOTE: the table points at the pages only after their copy
        self.store.publish(layer, expert, page_ids)
        self.stats.additions += 1

    # ---- inside a pass -----------------------------------------------------------------------------------------

    def on_routing(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> Callable[[], None] | None:
        """Make every expert routed at `layer` readable through `working_tables[layer]` before its kernel runs.
        Returns the next layer's prefetch, which only has to be issued before the next routing: the caller runs it
        at once (eager passes) or after queueing the next piece (CUDA graphs, so the GPU does not idle while the
        host issues the copies)."""
        start = time.perf_counter()
        for observe in self.observers:
            observe(layer, hidden, topk_ids)
        for key in [k for k in self.pending_add if k[0] == layer]:
            self._publish(*key)
        next_layer = self.next_layer.get(layer) if self.predict else None
        if next_layer is not None and not self.store.offloaded[next_layer]:
            next_layer = None  # nothing of the next layer to prefetch
        if self.popularity is not None:
            self._keep_ids(layer, topk_ids)  # counted after the pass (`_count_kept_ids`)
        prefetch, routed = None, set()
        if self.store.offloaded[layer] or next_layer is not None:  # with nothing on the host, no host sync
            routed, votes = self._routing_on_host(layer, hidden, topk_ids, next_layer)
            if next_layer is not None:
                prefetch = self._prefetch_later(next_layer, votes)
        self._load_routed(layer, routed & self.store.offloaded[layer], self.working_tables[layer])
        self.stats.hook_seconds += time.perf_counter() - start
        return prefetch

    def _routing_on_host(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         next_layer: int | None) -> tuple[set[int], list[int]]:  # fmt: skip
        """The experts routed here, and each expert's votes for `next_layer` (its router applied to this layer's
        input, the Fate idea), fetched in one device-to-host copy: the hook's only wait for the GPU. The counts go
        into one persistent [2E] buffer (routed, then votes): five kernels and the copy a layer."""
        num_experts, counts = self.store.num_experts, self._counts
        self._count_routed(topk_ids)
        if next_layer is not None:
            # NOTE: in the model's dtype (the router itself runs in fp32): a vote only orders prefetches, and two
            # conversions a layer less is host time off the step
            votes = torch.topk(hidden @ self.routers[next_layer].T, self.top_k, dim=-1).indices.flatten()  # [T K]
            counts[num_experts:].index_add_(0, votes, self._ones_for(votes.numel()))
        wait = time.perf_counter()
        host = counts.tolist()  # waits for the router
        self.stats.routing_wait_seconds += time.perf_counter() - wait
        return {e for e, n in enumerate(host[:num_experts]) if n}, host[num_experts:]

    def _count_routed(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert ([E] int64 on the device, a view of the persistent counts buffer, whose
        second half the votes may fill next); no host sync (`torch.bincount` would wait to size its output)."""
        ids, num_experts = topk_ids.flatten(), self.store.num_experts
        self._counts.zero_()
        return self._counts[:num_experts].index_add_(0, ids, self._ones_for(ids.numel()))

    def _ones_for(self, n: int) -> torch.Tensor:
        """n ones (int64) on the device, a view of one buffer grown to the largest batch seen."""
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int64, device=self._ones.device)
        return self._ones[:n]

    def _load_routed(self, layer: int, on_host: set[int], row: torch.Tensor) -> None:
        """Copy in the routed host experts that no prefetch brought, then write the layer's working table `row`:
        the store's table with these experts pointing at their loading-buffer slots, in one copy from the host."""
        if not on_host:
            if self._row_versions[layer] != self.store.versions[layer]:  # else the row is the store's already
                row.copy_(self.store.page_tables[layer])
                self._row_versions[layer] = self.store.versions[layer]
            return
        self._row_versions[layer] = None  # the row points at loading-buffer slots from here
        buffer = self.buffers[self.ordinal[layer] % 2]
        if buffer.layer != layer:
            buffer.layer, buffer.experts = layer, {}
        self.copier.wait(buffer.ready)
        hits = on_host & buffer.experts.keys()
        buffer.experts = {e: buffer.experts[e] for e in hits}  # NOTE: other slots get overwritten below
        taken = set(buffer.experts.values())
        free_slots = [s for s in range(len(buffer.slots)) if s not in taken]
        misses = []
        for expert in sorted(on_host - hits):
            slot = free_slots.pop(0)
            misses.append((buffer.slots[slot], self.store.host_rows(layer, expert)))
            buffer.experts[expert] = slot
        self.copier.copy_many(misses, side_stream=False)
        self.stats.prefetch_hits += len(hits)
        self.stats.prefetch_misses += len(misses)
        # NOTE: one staging table serves every layer: its last upload was queued on this stream before this hook's
        # routing wait (`_routing_on_host` synchronises the stream), so it has landed
        table = self._staging
        table.copy_(self.store.host_tables[layer])  # [E, 3]
        experts = sorted(on_host)
        table[experts] = torch.tensor([buffer.slots[buffer.experts[e]] for e in experts], dtype=torch.int32)
        row.copy_(table, non_blocking=row.is_cuda)  # from pinned memory: the host waits for nothing queued

    def _prefetch_later(self, layer: int, votes: list[int]) -> Callable[[], None]:
        """The prefetch of `layer` (`_prefetch`), to run later; its copies wait for what is queued now, which
        includes the last kernel that reads the buffer they overwrite."""
        last_reader = self.copier.compute_mark()  # the previous layer's kernel, queued before this hook

        def prefetch() -> None:
            start = time.perf_counter()
            self._prefetch(layer, votes, last_reader)
            seconds = time.perf_counter() - start
            self.stats.hook_seconds += seconds
            self.stats.prefetch_seconds += seconds

        return prefetch

    def _prefetch(self, layer: int, votes: list[int], last_reader) -> None:
        """Copy `layer`'s host experts with the most predicted tokens (`votes` [E]) into its buffer on the side
        stream, after the event `last_reader`."""
        buffer = self.buffers[self.ordinal[layer] % 2]
        on_host = self.store.offloaded[layer]
        predicted = sorted((e for e in on_host if votes[e]), key=lambda e: (-votes[e], e))[: len(buffer.slots)]
        buffer.layer, buffer.experts = layer, {expert: slot for slot, expert in enumerate(predicted)}
        copies = [(buffer.slots[slot], self.store.host_rows(layer, expert)) for slot, expert in enumerate(predicted)]
        ticket = self.copier.copy_many(copies, after=last_reader)
        if ticket is not None:  # nothing to copy: an earlier prefetch may still be landing in these slots
            buffer.ready = ticket
        self.stats.prefetched += len(predicted)

