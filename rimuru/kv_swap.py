"""`KVSwap`: a preempted request's KV pages copied to host memory and back, instead of recomputing its prompt.

When the scheduler must preempt (a request outgrew its forecast), the victim's pages are copied, every layer's in
table order, into one host tensor (pinned on a GPU) and freed; the request waits at the front of the queue with its
computed tokens kept. Re-admitted, it gets fresh pages (any ids, a fresh slot) and the saved contents are copied
into them in the same order, so its next step reads exactly the K and V it wrote: tokens are those of a run
without preemption. A token's KV crosses the host link twice, which costs less than a prefill recomputing it on the
GPUs Rimuru targets (docs/architecture.md); `preemption="recompute"` keeps the old way. Host memory for saved
pages is capped at the pool's size: beyond it a victim is recomputed.
"""

import torch

from rimuru.kv_cache import KVCacheManager
from rimuru.request import Request


class KVSwap:
    def __init__(self, kv_cache: KVCacheManager, kv_pages: torch.Tensor, max_bytes: int):
        self.kv_cache = kv_cache
        self.kv_pages = kv_pages  # the pool's KV view: [kv page ids, 2, page_tokens, Hk, Dh]
        self.max_bytes = max_bytes
        self._saved: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (tokens held, pages [n * L, ...])
        self.num_saved = 0  # preemptions recovered by a copy rather than a recompute

    @property
    def saved_bytes(self) -> int:
        return sum(pages.nbytes for _, pages in self._saved.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._saved

    def save(self, request: Request) -> bool:
        """Copy the request's pages to the host and free them; False (nothing done) when the host cap is reached."""
        num_pages = -(-request.num_computed_tokens // self.kv_cache.page_tokens)  # the pages its written KV fills
        page_bytes = self.kv_pages[0].nbytes
        if num_pages == 0 or self.saved_bytes + num_pages * self.kv_cache.num_layers * page_bytes > self.max_bytes:
            return False
        ids = self._page_ids(request.request_id, num_pages)
        on_gpu = self.kv_pages.device.type == "cuda"
        host = torch.empty((len(ids), *self.kv_pages.shape[1:]), dtype=self.kv_pages.dtype, pin_memory=on_gpu)
        host.copy_(self.kv_pages[ids])  # waits for the copy: the pages are freed next
        self._saved[request.request_id] = (request.num_computed_tokens, host)
        self.kv_cache.free(request.request_id)
        self.num_saved += 1
        return True

    def restore(self, request: Request) -> bool:
        """Pages for the saved tokens, their contents copied back; False (nothing done) when the pool is short."""
        tokens, host = self._saved[request.request_id]
        if not self.kv_cache.allocate(request.request_id, tokens):
            return False
        ids = self._page_ids(request.request_id, len(host) // self.kv_cache.num_layers)
        self.kv_pages[ids] = host.to(self.kv_pages.device, non_blocking=True)
        del self._saved[request.request_id]
        return True

    def drop(self, request_id: str) -> None:
        """Forget a saved request (it was aborted while it waited)."""
        self._saved.pop(request_id, None)

    def _page_ids(self, request_id: str, num_pages: int) -> torch.Tensor:
        """The request's page ids, layer by layer in table order: [L * num_pages]."""
        slot = self.kv_cache.slot(request_id)
        return self.kv_cache.tables[:, slot, :num_pages].reshape(-1).long().to(self.kv_pages.device)
