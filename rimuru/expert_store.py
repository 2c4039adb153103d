"""`ExpertStore`: where each routed expert lives, host or pool, and the per-layer expert page tables.

The master copy of every expert stays in host memory (`ExpertWeights`, pinned on GPU machines) and is never copied
back: evicting an expert only frees its three pages. `page_tables[l, e]` holds the (gate, up, down) page ids of a
resident expert, or -1 when it is on the host, on the pool's device; `host_tables` is its copy in host memory,
which the routing hook reads without waiting for the device. Mutated only by the engine thread, between and inside
steps as `ExpertChanges` and `ExpertLoader` order.
"""

import torch

from rimuru.expert_copier import ExpertCopier
from rimuru.memory import EXPERT, PAGES_PER_EXPERT, MemoryPool, PageAllocator
from rimuru.models import ExpertWeights


class ExpertStore:
    def __init__(self, experts: dict[int, ExpertWeights], num_layers: int, pool: MemoryPool, allocator: PageAllocator):
        self.host = experts
        self.layer_ids = sorted(experts)
        self.allocator = allocator
        self.expert_view = pool.expert_view()  # [P, F * D]
        self.copier = ExpertCopier(self.expert_view)
        self.num_experts = next(iter(experts.values())).gate.shape[0] if experts else 0
        # [L, E, 3] page ids of (gate, up, down); -1 where the expert is on the host or the layer is dense
        self.page_tables = torch.full((num_layers, max(self.num_experts, 1), 3), -1, dtype=torch.int32, device=pool.device)
        self.host_tables = torch.full_like(self.page_tables, -1, device="cpu")  # the same, for the host to read
        self._layer_index = torch.tensor(self.layer_ids, dtype=torch.int64)  # host_tables rows of the MoE layers
        self.offloaded: dict[int, set[int]] = {layer: set(range(self.num_experts)) for layer in self.layer_ids}
        self.versions = [0] * num_layers  # per layer, bumped at every change of its table: copies of a row go stale
        self._host_rows: dict[tuple[int, int], tuple] = {}  # (layer, expert) -> `host_rows`
        self.copy_log: list[tuple[int, int, list[int]]] | None = None  # the copies since it was last read (`copy_in`)

    @property
    def num_expert_pages(self) -> int:
        """Pages all routed experts take when every one is resident."""
        return len(self.layer_ids) * self.num_experts * PAGES_PER_EXPERT

    @property
    def num_offloaded(self) -> int:
        return sum(map(len, self.offloaded.values()))

    @property
    def num_resident(self) -> int:
        return len(self.layer_ids) * self.num_experts - self.num_offloaded

    def place(self, offload: dict[int, set[int]]) -> None:
        """Start-up: copy every expert not in `offload` into the pool; ValueError with the numbers if they do not fit."""
        wanted = [(layer, e) for layer in self.layer_ids for e in range(self.num_experts) if e not in offload.get(layer, ())]
        missing = len(wanted) * PAGES_PER_EXPERT - self.allocator.num_free_expert_pages
        if missing > 0:
            page = self.allocator.sizes.expert_page_bytes
            raise ValueError(
                f"{len(wanted)} resident experts need {len(wanted) * PAGES_PER_EXPERT} pages of {page} B "
                f"({len(wanted) * PAGES_PER_EXPERT * page / 2**30:.2f} GiB) but the pool has "
                f"{self.allocator.num_free_expert_pages} free: {missing * page / 2**30:.2f} GiB short; "
                f"raise gpu_memory_budget or offload more experts"
            )
        for layer, expert in wanted:
            page_ids = self.reserve(layer, expert)
            self.copy_in(layer, expert, page_ids, side_stream=False)
            self.publish(layer, expert, page_ids)

    def copy_in(self, layer: int, expert: int, page_ids: list[int], **options):
        """Start copying an expert's host matrices into its pages (`ExpertCopier.copy`'s event); logged in
        `copy_log` when there is one (tensor parallel ranks copy their own slices into the same pages)."""
        if self.copy_log is not None:
            self.copy_log.append((layer, expert, list(page_ids)))
        return self.copier.copy(page_ids, self.host_rows(layer, expert), **options)

    def host_mask(self) -> torch.Tensor:
        """[MoE layers, E] bool, True where the expert is on the host (rows in `layer_ids` order), from the host
        tables: no per-expert Python."""
        return self.host_tables.index_select(0, self._layer_index)[:, : self.num_experts, 2] < 0

    def host_rows(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An expert's (gate, up, down) host matrices as page rows ([F * D] views), made on first use and kept: the
        routing hook's copies take them without six view operations an expert."""
        rows = self._host_rows.get((layer, expert))
        if rows is None:
            rows = self._host_rows[(layer, expert)] = tuple(m.reshape(-1) for m in self.host[layer].matrices(expert))
        return rows

    def reserve(self, layer: int, expert: int) -> list[int] | None:
        """Three pages for an expert about to be copied in; None when the pool has none."""
        return self.allocator.allocate_expert((layer, expert))

    def publish(self, layer: int, expert: int, page_ids: list[int]) -> None:
        """Point the page table at an expert's pages. NOTE: only once its copy has finished (or is ordered before)."""
        self.host_tables[layer, expert] = torch.tensor(page_ids, dtype=torch.int32)
        self.page_tables[layer, expert] = self.host_tables[layer, expert]
        self.offloaded[layer].discard(expert)
        self.versions[layer] += 1

    def evict(self, layer: int, expert: int) -> None:
        """Clear the table entry and free the pages. NOTE: only after the last pass that may read them."""
        self.page_tables[layer, expert] = -1
        self.host_tables[layer, expert] = -1
        self.allocator.free((layer, expert))
        self.offloaded[layer].add(expert)
        self.versions[layer] += 1

    def pages_of(self, layer: int, expert: int) -> list[int]:
        return self.allocator.pages_of((layer, expert), EXPERT)
