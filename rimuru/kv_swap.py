"""`KVSwap`: a preempted request's pages copied to host memory and back, instead of recomputing its prompt.

When the scheduler must preempt (a request outgrew its forecast), the victim's KV pages, every layer's in table
order, and a hybrid model's linear-attention state pages (`LinearStateCache`) are copied into host tensors (pinned
on a GPU) before the scheduler frees them; the request waits at the front of the queue with its computed tokens
kept. Re-admitted, it gets fresh pages (any ids, a fresh slot) and the saved contents are copied into them in the
same order, so its next step reads exactly the K, V and state it wrote: tokens are those of a run without
preemption (a recomputed hybrid rebuilds its state in the prompt's chunk form, which rounds otherwise). A token's KV
crosses the host link twice, which costs less than a prefill recomputing it on the GPUs Rimuru targets
(docs/architecture.md), but not always for a hybrid's fixed-size state: `PreemptionCost` weighs the two on the
engine's measured link and prefill rates, victim by victim. `preemption="recompute"` keeps the old way. Host memory
for saved pages is capped at the pool's size: beyond it a victim is recomputed.

Under tensor parallelism each save and restore is also logged as a `PageSwap` for the other ranks, which copy their
own pages (their shards of the same page ids) into their own `HostPages` in the same order.
"""

import time
from dataclasses import dataclass

import torch

from rimuru.kv_cache import KVCacheManager
from rimuru.linear_state_cache import LinearStateCache
from rimuru.preemption_cost import PreemptionCost
from rimuru.request import Request


@dataclass
class PageSwap:
    """One save or restore, for the other tensor parallel ranks to repeat on their pools."""

    kind: str  # "save", "restore" or "drop" (aborted while saved)
    request_id: str
    pages: dict[str, list[int]]  # pool view name -> page ids, in the order the host copy holds them


class HostPages:
    """Host copies of pages of named pool views ("kv", "ssm", "conv"), by request."""

    def __init__(self, views: dict[str, torch.Tensor]):
        self.views = views
        self._saved: dict[str, dict[str, torch.Tensor]] = {}  # request id -> view name -> [pages, ...]

    @property
    def saved_bytes(self) -> int:
        return sum(t.nbytes for saved in self._saved.values() for t in saved.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._saved

    def save(self, request_id: str, pages: dict[str, torch.Tensor]) -> None:
        """Copy the pages to the host; waits for the copy, as the caller frees the pages next."""
        self._saved[request_id] = {name: _to_host(self.views[name], ids) for name, ids in pages.items()}

    def restore(self, request_id: str, pages: dict[str, torch.Tensor]) -> None:
        """Copy a saved request's contents into `pages` (fresh ids, the same count a view) and forget them."""
        for name, host in self._saved.pop(request_id).items():
            view = self.views[name]
            view[pages[name].to(view.device)] = host.to(view.device, non_blocking=True)

    def drop(self, request_id: str) -> None:
        self._saved.pop(request_id, None)

    def apply(self, swap: PageSwap) -> None:
        """Repeat rank 0's save or restore on this rank's pool."""
        if swap.kind == "drop":
            return self.drop(swap.request_id)
        pages = {name: torch.tensor(ids, dtype=torch.int64) for name, ids in swap.pages.items()}
        (self.restore if swap.kind == "restore" else self.save)(swap.request_id, pages)


class KVSwap:
    def __init__(self, kv_cache: KVCacheManager, views: dict[str, torch.Tensor], max_bytes: int,
                 states: LinearStateCache | None = None):  # fmt: skip
        self.kv_cache = kv_cache
        self.host = HostPages(views)  # "kv": [kv page ids, 2, page_tokens, Hk, Dh]; a hybrid's "ssm" and "conv"
        self.max_bytes = max_bytes
        self.states = states  # a hybrid's state pages; None: the model has none
        self._tokens: dict[str, int] = {}  # request id -> computed tokens whose KV is saved
        self.log: list | None = None  # tensor parallel: each `PageSwap` for the other ranks, beside the expert copies
        self.num_saved = 0  # preemptions recovered by a copy rather than a recompute
        self.cost = PreemptionCost()  # the engine feeds it its steps; the saves time the link

    @property
    def saved_bytes(self) -> int:
        return self.host.saved_bytes

    def holds(self, request_id: str) -> bool:
        return request_id in self._tokens

    def save(self, request: Request) -> bool:
        """Copy the request's pages to the host, which the caller then frees; False (nothing done) when the host cap
        is reached or recomputing the request costs less."""
        num_pages = -(-request.num_computed_tokens // self.kv_cache.page_tokens)  # the pages its written KV fills
        num_bytes = self._bytes(num_pages)
        if num_pages == 0 or self.saved_bytes + num_bytes > self.max_bytes:
            return False
        if not self.cost.swap_is_cheaper(num_bytes, request.num_computed_tokens):
            return False
        pages = self._pages(request.request_id, num_pages)
        start = time.perf_counter()
        self.host.save(request.request_id, pages)
        self.cost.observe_copy(num_bytes, time.perf_counter() - start)
        self._tokens[request.request_id] = request.num_computed_tokens
        self._log("save", request.request_id, pages)
        self.num_saved += 1
        return True

    def restore(self, request: Request) -> bool:
        """Pages for the saved tokens, their contents copied back (and a hybrid's state into the state pages the
        scheduler took first); False (nothing done) when the pool is short."""
        tokens = self._tokens[request.request_id]
        if not self.kv_cache.allocate(request.request_id, tokens):
            return False
        pages = self._pages(request.request_id, -(-tokens // self.kv_cache.page_tokens))
        self.host.restore(request.request_id, pages)
        del self._tokens[request.request_id]
        self._log("restore", request.request_id, pages)
        return True

    def drop(self, request_id: str) -> None:
        """Forget a saved request (it was aborted while it waited)."""
        if self._tokens.pop(request_id, None) is not None:
            self.host.drop(request_id)
            self._log("drop", request_id, {})

    def _bytes(self, num_pages: int) -> int:
        """Host bytes of a request whose KV fills `num_pages` pages a layer, with a hybrid's state."""
        views = self.host.views
        kv = num_pages * self.kv_cache.num_layers * views["kv"][0].nbytes
        if self.states is None:
            return kv
        return kv + self.states.num_linear_layers * (views["ssm"][0].nbytes + views["conv"][0].nbytes)

    def _pages(self, request_id: str, num_pages: int) -> dict[str, torch.Tensor]:
        """The request's page ids a view: KV layer by layer in table order [L * num_pages], a hybrid's state pages
        in layer order."""
        slot = self.kv_cache.slot(request_id)
        pages = {"kv": self.kv_cache.tables[:, slot, :num_pages].reshape(-1).long()}
        if self.states is not None:
            pages["ssm"], pages["conv"] = self.states.page_ids(request_id)
        return pages

    def _log(self, kind: str, request_id: str, pages: dict[str, torch.Tensor]) -> None:
        if self.log is not None:
            self.log.append(PageSwap(kind, request_id, {name: ids.tolist() for name, ids in pages.items()}))


def swap_views(pool, hybrid: bool) -> dict[str, torch.Tensor]:
    """The pool views a swap copies: KV, and a hybrid's SSM and conv pages."""
    views = {"kv": pool.kv_view()}
    return views | {"ssm": pool.ssm_view(), "conv": pool.conv_view()} if hybrid else views


def _to_host(view: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The pages `ids` of a pool view in a host tensor (pinned when the pool is on a GPU); waits for the copy."""
    host = torch.empty((len(ids), *view.shape[1:]), dtype=view.dtype, pin_memory=view.device.type == "cuda")
    host.copy_(view[ids.to(view.device)])
    return host
