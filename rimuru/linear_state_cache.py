"""Each running request's linear-attention state in the pool: one SSM page (the gated delta rule's recurrent state)
and one conv page (the conv history) per linear layer, taken at admission and held until the request ends.

Unlike KV, the state does not grow with the sequence, so a request needs all of its pages at once or none. The pages
belong to `(request_id, "state")`, so freeing a request's KV never frees its state and the other way round.
"""

import torch

from rimuru.memory import CONV, EXPERT, KV, SSM, PageAllocator


class LinearStateCache:
    def __init__(self, allocator: PageAllocator, num_linear_layers: int):
        self.allocator = allocator
        self.num_linear_layers = num_linear_layers
        self._pages: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (SSM ids, conv ids), layer order

    @staticmethod
    def _owner(request_id: str) -> tuple[str, str]:
        return (request_id, "state")

    def holds(self, request_id: str) -> bool:
        return request_id in self._pages

    def expert_pages_per_request(self) -> int:
        """Expert pages' worth of one request's state, rounded up: what the adjuster must free to admit it."""
        sizes, layers = self.allocator.sizes, self.num_linear_layers
        ssm = -(-layers * sizes.ssm_page_stride // sizes.expert_page_bytes)
        return ssm + self.allocator.expert_pages_for(layers, CONV)

    def expert_pages_for_requests(self, num_requests: int) -> int:
        """Expert pages that the states of `num_requests` requests take from a pool holding no state yet: SSM pages
        are cut from whole huge pages, conv pages from whole expert pages (a tiny model's one request may take a
        huge page for a few SSM pages)."""
        ssm_pages, conv_pages = num_requests * self.num_linear_layers, num_requests * self.num_linear_layers
        huge_pages = -(-ssm_pages // self.allocator.children[SSM])
        return huge_pages * self.allocator.children[EXPERT] + self.allocator.expert_pages_for(conv_pages, CONV)

    def kv_pages_per_request(self) -> int:
        """One request's state as KV pages (all layers together): the shortfall the scheduler records when it is
        refused, in the unit the adjuster is told KV shortfalls in."""
        return self.expert_pages_per_request() * self.allocator.children[KV]

    def allocate(self, request_id: str) -> bool:
        """Every layer's SSM and conv page for a new request; False (and nothing taken) when the pool cannot give
        them all."""
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds its state pages")
        layers, owner = self.num_linear_layers, self._owner(request_id)
        if not (self.allocator.can_allocate(layers, SSM) and self.allocator.can_allocate(layers, CONV)):
            return False
        ssm = self.allocator.allocate(owner, layers, SSM)
        conv = self.allocator.allocate(owner, layers, CONV)
        if ssm is None or conv is None:  # both kinds draw on free huge pages: the second can fail after the first
            self.allocator.free(owner)
            return False
        self._pages[request_id] = (ssm, conv)
        return True

    def free(self, request_id: str) -> None:
        """Give a finished or preempted request's state pages back (a preempted one had them saved by `KVSwap`, or
        recomputes its state)."""
        del self._pages[request_id]
        self.allocator.free(self._owner(request_id))

    def page_ids(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(SSM page ids, conv page ids) of one request, in layer order."""
        ssm, conv = self._pages[request_id]
        return torch.tensor(ssm), torch.tensor(conv)

    def state_tables(self, request_ids: list[str], device: torch.device | str = "cpu"):
        """([L, B] SSM page ids, [L, B] conv page ids) of a batch: row l is what layer l's kernels index."""
        ssm = [self._pages[r][0] for r in request_ids]
        conv = [self._pages[r][1] for r in request_ids]
        return self._by_layer(ssm).to(device), self._by_layer(conv).to(device)

    def _by_layer(self, ids_by_request: list[list[int]]) -> torch.Tensor:
        table = torch.tensor(ids_by_request, dtype=torch.int64).reshape(len(ids_by_request), self.num_linear_layers)
        return table.T.contiguous()
