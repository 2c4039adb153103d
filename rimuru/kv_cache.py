"""`KVCacheManager`: each request's KV pages, one page table per attention layer, over the shared allocator.

A request holds the same number of pages in every layer. New pages are asked of the `PageAllocator` as one block of
`new_pages * L` (so they tend to come from one expert page) and dealt out layer by layer:

    ids = [a0 a1 ... a(L-1) | b0 b1 ... b(L-1)]   ->   layer l gets page a_l, then b_l
    tables[l, slot, i] = page id of the request's i-th page in layer l  (-1 beyond)

The tables live in one host tensor indexed by a per-request slot, so a batch's tables are a single gather; with
`device_copy` the same tables are kept on the device too (CUDA graphs gather a batch's rows there), brought up to
date by `sync_device` before each pass: the slots changed since are copied in one transfer, not one a page
allocation (a round of 140 decodes crosses about 9 page boundaries).
"""

import numpy as np
import torch

from rimuru.memory import KV, PageAllocator


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, num_layers: int, page_tokens: int, max_slots: int, max_model_len: int,
                 device_copy: torch.device | None = None):  # fmt: skip
        self.allocator = allocator
        self.num_layers, self.page_tokens = num_layers, page_tokens
        self.max_pages = -(-max_model_len // page_tokens)
        self.tables = torch.full((num_layers, max_slots, self.max_pages), -1, dtype=torch.int32)  # [L, slots, P]
        # the same memory as a numpy array: the host writes a few entries a step, and numpy indexes small slices
        # with less overhead than torch (docs/benchmarks/allocator.md)
        self._tables_np = self.tables.numpy()
        # the same tables on the device, for CUDA graphs that gather them there (equal after `sync_device`); None: none
        self.device_tables = None if device_copy is None else self.tables.to(device_copy, copy=True)
        self._stale_slots: set[int] = set()  # slots whose device rows lag the host's (`sync_device`)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._num_pages: dict[str, int] = {}  # pages per layer held by each request

    def slot(self, request_id: str) -> int:
        return self._slot[request_id]

    def pages_held(self, request_id: str) -> int:
        """Pages a layer the request holds now."""
        return self._num_pages.get(request_id, 0)

    def num_new_pages(self, request_id: str, num_tokens: int) -> int:
        """Pages (all layers together) a request must add to hold `num_tokens` tokens. Does not mutate."""
        have = self._num_pages.get(request_id, 0)
        return max(0, -(-num_tokens // self.page_tokens) - have) * self.num_layers

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's pages to hold `num_tokens`; False (and no change) when the pool cannot."""
        have = self._num_pages.get(request_id, 0)
        if num_tokens <= have * self.page_tokens:  # most calls: a decode step inside the pages it holds
            return True
        num_new = self.num_new_pages(request_id, num_tokens)
        if request_id not in self._slot and not self._free_slots:
            return False
        page_ids = self.allocator.allocate(request_id, num_new, KV)
        if page_ids is None:
            return False
        slot = self._slot.get(request_id)
        if slot is None:
            slot = self._slot[request_id] = self._free_slots.pop()
        per_layer = num_new // self.num_layers
        block = np.asarray(page_ids, dtype=np.int32).reshape(per_layer, self.num_layers)  # [new, L]
        self._tables_np[:, slot, have : have + per_layer] = block.T
        self._mark_stale(slot)
        self._num_pages[request_id] = have + per_layer
        return True

    def free(self, request_id: str) -> None:
        """Return every page of the request to the pool; a request holding none is a no-op."""
        slot = self._slot.pop(request_id, None)
        if slot is None:
            return
        self.allocator.free(request_id)
        num_pages = self._num_pages.pop(request_id)
        self._tables_np[:, slot, :num_pages] = -1
        self._mark_stale(slot)
        self._free_slots.append(slot)

    def _mark_stale(self, slot: int) -> None:
        if self.device_tables is not None:
            self._stale_slots.add(slot)

    def sync_device(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copy the rows of the slots changed since the last call to the device tables: one gather of whole rows
        (contiguous runs of P, which gather faster than rows cut to the pages in use) and one transfer. The pass
        that reads them must come after. Returns (slots [S], rows [L, S, P]) as copied (tensor parallel ranks copy
        them into theirs), None when nothing changed."""
        if not self._stale_slots:
            return None
        slots = torch.tensor(sorted(self._stale_slots), dtype=torch.int64)
        self._stale_slots.clear()
        rows = self.tables.index_select(1, slots)  # [L, stale slots, P]
        device = self.device_tables.device
        self.device_tables.index_copy_(1, slots.to(device), rows.to(device))
        return slots, rows

    def tokens_in(self, num_small_pages: int) -> int:
        """Tokens one request can store in every layer with `num_small_pages` KV pages."""
        return num_small_pages // self.num_layers * self.page_tokens
