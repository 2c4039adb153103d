"""`ExpertStore`: routed-expert weights in pool pages and the per-layer expert page tables (DESIGN.md section 3).

The master copy of every expert stays in host memory (`ExpertWeights`, pinned on GPU machines); the store copies
an expert's three matrices (gate, up, down) into three expert pages and points the layer's page table at them.
With the `resident` policy every expert is placed at start-up, and the store refuses to start, saying by how
much, when they do not fit.
"""

import torch

from rimuru.memory import PAGES_PER_EXPERT, MemoryPool, PageAllocator
from rimuru.models import ExpertWeights


class ExpertStore:
    def __init__(self, experts: dict[int, ExpertWeights], num_layers: int, pool: MemoryPool, allocator: PageAllocator):
        self.host = experts
        self.pool, self.allocator = pool, allocator
        self.expert_view = pool.expert_view()  # [P, F * D]
        self.num_experts = next(iter(experts.values())).gate.shape[0] if experts else 0
        # [L, E, 3] page ids of (gate, up, down); -1 where the expert is not in the pool or the layer is dense
        self.page_tables = torch.full((num_layers, max(self.num_experts, 1), 3), -1, dtype=torch.int32, device=pool.device)

    @property
    def num_expert_pages(self) -> int:
        return len(self.host) * self.num_experts * PAGES_PER_EXPERT

    def place_all(self) -> None:
        """Copy every expert into the pool (the `resident` policy); ValueError with the numbers if they do not fit."""
        missing = self.num_expert_pages - self.allocator.num_free_expert_pages
        if missing > 0:
            page = self.allocator.sizes.expert_page_bytes
            raise ValueError(
                f"the routed experts need {self.num_expert_pages} pages of {page} B "
                f"({self.num_expert_pages * page / 2**30:.2f} GiB) but the pool holds {self.allocator.num_free_expert_pages}: "
                f"{missing * page / 2**30:.2f} GiB short; raise gpu_memory_budget"
            )
        for layer_idx in self.host:
            for expert_id in range(self.num_experts):
                self.load(layer_idx, expert_id)

    def load(self, layer_idx: int, expert_id: int) -> bool:
        """Copy one expert into fresh pages and publish them in its page table; False if the pool is full."""
        page_ids = self.allocator.allocate_expert((layer_idx, expert_id))
        if page_ids is None:
            return False
        for page_id, matrix in zip(page_ids, self.host[layer_idx].matrices(expert_id)):
            self.expert_view[page_id].copy_(matrix.reshape(-1), non_blocking=True)
        self.page_tables[layer_idx, expert_id] = torch.tensor(page_ids, dtype=torch.int32)
        return True
