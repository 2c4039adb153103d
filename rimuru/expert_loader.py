"""`ExpertLoader`: the copy hook (expert_reads="copy") that makes each routed host expert readable before its MoE
layer's kernel, and the working page tables the kernels read (docs/architecture.md, Expert tiers and One round).

`on_routing` runs before each MoE layer's kernel:
  1. the layer's working page table = the resident table, plus finished additions (`ExpertChanges.publish_layer`);
  2. routed experts on the host: prefetched ones are hits, the rest are copied now into a loading buffer (misses);
  3. prediction for the next MoE layer (its router on this layer's input, the Fate idea): its offloaded experts,
     ranked by predicted tokens, are prefetched into the other buffer on the side stream. The hook returns that
     prefetch for its caller to run: under CUDA graphs after the next piece is queued, so the GPU computes while
     the host issues the copies.
The two buffers, each `buffer_experts` experts x 3 pages inside the pool, alternate by MoE layer ordinal. The
routing itself is counted by the `RoutingCounter` (`see`, `tally`), never here.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rimuru.expert_changes import ExpertChanges
from rimuru.expert_stats import ExpertStats
from rimuru.expert_store import ExpertStore
from rimuru.memory import EXPERT, PAGES_PER_EXPERT
from rimuru.routing_counter import RoutingCounter


@dataclass
class _Buffer:
    slots: list[list[int]]  # slot -> the three page ids
    layer: int | None = None  # the MoE layer whose experts the slots hold now
    experts: dict[int, int] = field(default_factory=dict)  # expert -> slot
    ready: object = None  # event: prefetch copies done


class ExpertLoader:
    def __init__(self, store: ExpertStore, changes: ExpertChanges, counter: RoutingCounter, stats: ExpertStats,
                 buffer_experts: int, routers: dict[int, torch.Tensor], top_k: int, predict: bool = True):  # fmt: skip
        self.store, self.copier, self.changes, self.counter, self.stats = store, store.copier, changes, counter, stats
        self.routers, self.top_k = routers, top_k  # MoE layer -> router weight [E, D]; experts per token
        self.predict = predict
        moe_layers = store.layer_ids
        self.next_layer = dict(zip(moe_layers, moe_layers[1:]))
        self.ordinal = {layer: i for i, layer in enumerate(moe_layers)}
        self.buffers = [self._reserve_buffer(i, buffer_experts) for i in range(2)] if buffer_experts else []
        self.working_tables = store.page_tables.clone()  # [L, E, 3] what the kernels read this pass
        # per layer, the store's table version its working row equals; None while the row points at loading buffers
        self._row_versions: list[int | None] = list(store.versions)
        self._counts = torch.zeros(2 * store.num_experts, dtype=torch.int64, device=store.page_tables.device)
        # a layer's working row written from the host (pinned on a GPU: a pageable copy would make the host wait for
        # everything queued on the stream, the miss copies included)
        on_gpu = store.page_tables.is_cuda
        self._staging = torch.empty(store.host_tables.shape[1:], dtype=torch.int32, pin_memory=on_gpu)  # [E, 3]

    def _reserve_buffer(self, index: int, num_experts: int) -> _Buffer:
        page_ids = self.store.allocator.allocate(("loading-buffer", index), num_experts * PAGES_PER_EXPERT, EXPERT)
        if page_ids is None:
            raise ValueError(f"the pool cannot hold two loading buffers of {num_experts} experts")
        return _Buffer([page_ids[i : i + PAGES_PER_EXPERT] for i in range(0, len(page_ids), PAGES_PER_EXPERT)])

    def refresh_working_tables(self) -> None:
        """Make `working_tables` the store's tables, for a pass whose kernels read it with no hook to update it."""
        self.working_tables.copy_(self.store.page_tables)
        self._row_versions = list(self.store.versions)

    def on_routing(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> Callable[[], None] | None:
        """Make every expert routed at `layer` readable through `working_tables[layer]` before its kernel runs.
        Returns the next layer's prefetch, which only has to be issued before the next routing: the caller runs it
        at once (eager passes) or after queueing the next piece (CUDA graphs, so the GPU does not idle while the
        host issues the copies)."""
        start = time.perf_counter()
        self.counter.see(layer, hidden, topk_ids)  # observers; ids kept, counted after the pass
        self.changes.publish_layer(layer)
        next_layer = self.next_layer.get(layer) if self.predict else None
        if next_layer is not None and not self.store.offloaded[next_layer]:
            next_layer = None  # nothing of the next layer to prefetch
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
        ids = topk_ids.flatten()
        counts.zero_()
        self.counter.tally(counts[:num_experts], ids)
        if next_layer is not None:
            # NOTE: in the model's dtype (the router itself runs in fp32): a vote only orders prefetches, and two
            # conversions a layer less is host time off the step
            votes = torch.topk(hidden @ self.routers[next_layer].T, self.top_k, dim=-1).indices.flatten()  # [T K]
            self.counter.tally(counts[num_experts:], votes)
        wait = time.perf_counter()
        host = counts.tolist()  # waits for the router
        self.stats.routing_wait_seconds += time.perf_counter() - wait
        return {e for e, n in enumerate(host[:num_experts]) if n}, host[num_experts:]

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
        misses = self._copy_misses(layer, buffer, sorted(on_host - hits))
        self.stats.prefetch_hits += len(hits)
        self.stats.prefetch_misses += misses
        # NOTE: one staging table serves every layer: its last upload was queued on this stream before this hook's
        # routing wait (`_routing_on_host` synchronises the stream), so it has landed
        table = self._staging
        table.copy_(self.store.host_tables[layer])  # [E, 3]
        experts = sorted(on_host)
        table[experts] = torch.tensor([buffer.slots[buffer.experts[e]] for e in experts], dtype=torch.int32)
        row.copy_(table, non_blocking=row.is_cuda)  # from pinned memory: the host waits for nothing queued

    def _copy_misses(self, layer: int, buffer: _Buffer, experts: list[int]) -> int:
        """Copy `experts` into free slots of `buffer` on the compute stream (the layer's kernel waits for them
        anyway); returns how many."""
        taken = set(buffer.experts.values())
        free_slots = [s for s in range(len(buffer.slots)) if s not in taken]
        misses = []
        for expert in experts:
            slot = free_slots.pop(0)
            misses.append((buffer.slots[slot], self.store.host_rows(layer, expert)))
            buffer.experts[expert] = slot
        self.copier.copy_many(misses, side_stream=False)
        return len(misses)

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
