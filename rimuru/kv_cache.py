"""`KVCacheManager`: each request's KV pages, one page table per attention layer, over the shared allocator.

A request holds the same number of pages in every layer. New pages are asked of the `PageAllocator` as one block of
`new_pages * L` (so they tend to come from one expert page) and dealt out layer by layer:

    ids = [a0 a1 ... a(L-1) | b0 b1 ... b(L-1)]   ->   layer l gets page a_l, then b_l
    tables[l, slot, i] = page id of the request's i-th page in layer l  (-1 beyond)

The tables live in one host tensor indexed by a per-request slot, so a batch's tables are a single gather; with
`device_copy` the same tables are kept on the device too (CUDA graphs gather a batch's rows there), brought up to
date by `sync_device` before each pass: the entries changed since (each stale slot's span of page columns, in every
layer) are copied in one transfer, not one a page allocation (a round of 140 decodes crosses about 9 page
boundaries), and not whole rows (Qwen3-30B-A3B's are 48 layers of 2,560 pages: 480 KiB a slot).
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
        self._stale: dict[int, tuple[int, int]] = {}  # slot -> [first, end) page columns its device rows lag in
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
        self._mark_stale(slot, have, have + per_layer)
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
        self._mark_stale(slot, 0, num_pages)
        self._free_slots.append(slot)

    def _mark_stale(self, slot: int, first: int, end: int) -> None:
        if self.device_tables is not None and end > first:
            lo, hi = self._stale.get(slot, (first, end))
            self._stale[slot] = (min(lo, first), max(hi, end))

    def sync_device(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Copy the entries changed since the last call to the device tables: each stale slot's span of columns in
        every layer, gathered on the host in one numpy index and written with one transfer and one scatter. The
        pass that reads them must come after. Returns (slots [N], columns [N], values [L, N]) as copied (tensor
        parallel ranks write them into theirs), None when nothing changed."""
        if not self._stale:
            return None
        spans = sorted(self._stale.items())
        self._stale.clear()
        slots = np.concatenate([np.full(end - first, slot, dtype=np.int64) for slot, (first, end) in spans])
        columns = np.concatenate([np.arange(first, end, dtype=np.int64) for _, (first, end) in spans])
        values = torch.from_numpy(self._tables_np[:, slots, columns])  # [L, N]
        slots, columns = torch.from_numpy(slots), torch.from_numpy(columns)
        write_entries(self.device_tables, slots, columns, values)
        return slots, columns, values

    def tokens_in(self, num_small_pages: int) -> int:
        """Tokens one request can store in every layer with `num_small_pages` KV pages."""
        return num_small_pages // self.num_layers * self.page_tokens


def write_entries(tables: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor, values: torch.Tensor) -> None:
    """tables[:, slots[i], columns[i]] = values[:, i] on the tables' device (tables [L, slots, P])."""
    device = tables.device
    tables[:, slots.to(device, non_blocking=True), columns.to(device, non_blocking=True)] = values.to(
        device, non_blocking=True)  # fmt: skip
