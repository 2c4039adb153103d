"""`Scheduler`: continuous batching with chunked prefill over the page pool (docs/architecture.md, One round).

Each round: running requests first, in admission order (a decode is one token; an unfinished prefill gets the next
chunk), then waiting requests while the token budget, `max_num_seqs` and the pool allow. A waiting request is
admitted only when the pool can carry it and the running batch to their ends (`GrowthForecast`: its prompt fitting
today is not enough, since the batch keeps growing a token a request a step); while the batch only decodes, a
refusal stands a few rounds without recomputing the forecast. When a running request still cannot
get its pages (it outgrew its forecast), the newest running request is preempted: its pages are freed and it waits
at the front of the queue to be recomputed, prompt and output alike, so its output is exactly what it would have
been; with a `KVSwap` its pages are copied to the host instead and back when it is re-admitted, its computed tokens
kept (`rimuru/kv_swap.py`). The KV pages the round was short of, admissions refused included, are recorded for the adjuster. While the
adjuster can still evict experts to cover them (`reclaimable_expert_pages`), a request that does not fit simply sits
this round out instead of being preempted: the evicted experts' pages serve it next round.

A hybrid model's request also holds its linear-attention state (`LinearStateCache`): taken whole at admission,
before its KV, counted in the admission forecast and in the round's shortfall, and given back when it finishes or is
preempted (a `KVSwap` saves the state pages with the KV pages; a recompute rebuilds the state from its tokens).
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rimuru.admission import GrowthForecast
from rimuru.kv_cache import KVCacheManager
from rimuru.kv_swap import KVSwap
from rimuru.linear_state_cache import LinearStateCache
from rimuru.ops.reference import DELTA_RULE_BLOCK
from rimuru.request import Request, RequestStatus

REFUSAL_ROUNDS = 4  # rounds a forecast's refusal stands while nothing but decoding changes


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # in batch order
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each request computes this round
    preempted: list[Request] = field(default_factory=list)  # requests sent back to the queue this round
    kv_shortfall_pages: int = 0  # KV pages (all layers) the round wanted but the pool did not have

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 reclaimable_expert_pages: Callable[[bool], int] = lambda stalled: 0,
                 swap: KVSwap | None = None, states: LinearStateCache | None = None):  # fmt: skip
        self.config = config
        self.kv_cache = kv_cache
        self.swap = swap  # None: a preempted request recomputes its prompt
        self.states = states  # a hybrid model's linear-attention state pages; None: the model has none
        self.reclaimable_expert_pages = reclaimable_expert_pages
        self._unmet_pages = 0  # KV pages asked for this round and not granted
        self._refused_pages = 0  # KV pages the forecast lacked to admit the next waiting request this round
        self.forecast = GrowthForecast(kv_cache.page_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_refusals = 0  # rounds whose next waiting request the forecast kept out
        self._refusal: tuple | None = None  # (`_decoding_key`, pages lacking, rounds it still stands)

    def add(self, request: Request) -> None:
        request.waiting_since = time.monotonic()
        self.waiting.append(request)

    @property
    def stalled(self) -> bool:
        """At most one request runs: nothing but evicting experts can free pages (it overrides the cost rule)."""
        return len(self.running) <= 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Choose this round's requests and token counts, allocating their KV pages. Mutates queues and pages."""
        batch = ScheduledBatch()
        self._unmet_pages = self._refused_pages = 0
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        unmet = max(0, self._unmet_pages - self.kv_cache.allocator.num_free_small_pages())
        batch.kv_shortfall_pages = unmet + self._refused_pages
        return batch

    def growth_pages(self) -> int:
        """KV pages (all layers) the running batch is forecast to add beyond what it holds: pages the adjuster must
        leave to KV rather than grow experts into."""
        peak = self.forecast.peak_pages(self.running)
        return max(0, peak * self.kv_cache.num_layers - self._held_pages())

    def _held_pages(self) -> int:
        """KV pages (all layers) the running requests hold."""
        return sum(map(self.kv_cache.pages_held, (r.request_id for r in self.running))) * self.kv_cache.num_layers

    def _capacity_pages(self) -> int:
        """KV pages a layer the running batch can have: what it holds plus what is free."""
        free = self.kv_cache.allocator.num_free_small_pages()
        return (free + self._held_pages()) // self.kv_cache.num_layers

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = 0 if request.reaches_max_tokens else self._num_new(request, budget)
            # 0: a hybrid's prompt chunk waits for a round whose budget reaches its next block, or the request's
            # pending token is its last (async scheduling: it finishes when the token reaches the host)
            if num_new == 0:
                index += 1
                continue
            placed = self._allocate_or_preempt(request, num_new, batch)
            if placed:
                batch.add(request, num_new)
                budget -= num_new
            if placed or request.status is RequestStatus.RUNNING:  # placed, or sitting this round out
                index += 1
        return budget

    def _num_new(self, request: Request, budget: int) -> int:
        """Tokens `request` computes this round: what it has left, within `budget`. A hybrid's prompt is cut at a
        multiple of the delta rule's block from its first token, so that the budget and the batch beside it never
        move where its state's blocks round: 0 (not this round) when the budget falls short of the next block but a
        round's could reach it; a step limit that never could cuts anywhere."""
        left = request.num_tokens - request.num_computed_tokens
        num_new = min(left, budget)
        if self.states is None or num_new == left:
            return num_new
        end = request.num_computed_tokens + num_new
        aligned = end - end % DELTA_RULE_BLOCK - request.num_computed_tokens
        reachable = self.config.max_num_batched_tokens - len(self.running) >= DELTA_RULE_BLOCK
        return aligned if aligned > 0 or reachable else num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Pages for `request`; when short, wait for the adjuster if it can cover the shortfall, else preempt the
        newest running requests until they fit. False if the request is not scheduled this round."""
        target = request.num_computed_tokens + num_new
        if self.kv_cache.allocate(request.request_id, target):
            return True
        if self._adjuster_can_cover(self.kv_cache.num_new_pages(request.request_id, target)):
            return False
        while not self.kv_cache.allocate(request.request_id, target):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                raise MemoryError(
                    f"request {request.request_id} needs {target} tokens of KV cache, more than the whole pool holds"
                )
            self._preempt(self.running.pop(), batch)
            if victim is request:
                return False
        return True

    def _adjuster_can_cover(self, wanted_pages: int) -> bool:
        """Record an unmet request for KV pages; True if evicting experts could cover everything unmet so far."""
        self._unmet_pages += wanted_pages
        short = self._unmet_pages - self.kv_cache.allocator.num_free_small_pages()
        return self.kv_cache.allocator.expert_pages_for(short) + 1 <= self.reclaimable_expert_pages(self.stalled)

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        if self.swap is None or not self.swap.save(request):
            request.num_computed_tokens = 0
        self.kv_cache.free(request.request_id)
        self._free_state(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.waiting_since = time.monotonic()
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _decoding_key(self) -> tuple | None:
        """What decides the forecast's answer for the next waiting request while every running request decodes:
        then each grows a token a round and their demand over time is fixed until one ends. The answer can still
        turn (the waiting request's own growth meets the batch's ends sooner each round), so a refusal stands for
        `REFUSAL_ROUNDS` rounds of one key at most. None while some request is still prefilling."""
        if any(r.num_computed_tokens != r.num_tokens - 1 for r in self.running):
            return None
        ids = tuple(r.request_id for r in self.running)
        return self.waiting[0].request_id, self._capacity_pages(), self.forecast.ratio, ids

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        key = self._decoding_key() if self.waiting and self.running else None
        if key is not None and self._refusal is not None and self._refusal[0] == key and self._refusal[2] > 0:
            self._refusal = (key, self._refusal[1], self._refusal[2] - 1)
            self._refused_pages, self.num_refusals = self._refusal[1], self.num_refusals + 1
            return  # refused again without the forecast's two passes (most of a round's host time)
        admission = _Admission(self) if self.waiting else None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = self._num_new(request, budget)
            if num_new == 0:
                return
            if not admission.admits(request) and self.running:  # alone it is served: it may stop early
                self._refused_pages = admission.lacking * self.kv_cache.num_layers
                self.num_refusals += 1
                fresh = key is not None and len(self.running) == len(key[3])  # nothing joined before it this round
                self._refusal = (key, self._refused_pages, REFUSAL_ROUNDS - 1) if fresh else None
                return
            target = request.num_computed_tokens + num_new
            if not self._state_taken(request):
                if not self._adjuster_can_cover(self.states.kv_pages_per_request()) and not self.running:
                    raise MemoryError(f"request {request.request_id} needs its linear-attention state, more than the "
                                      "pool holds")  # fmt: skip
                return
            if not self._restored(request) or not self.kv_cache.allocate(request.request_id, target):
                self._free_state(request)  # a waiting request holds no pages
                if self._adjuster_can_cover(self.kv_cache.num_new_pages(request.request_id, target)):
                    return
                if not self.running:
                    raise MemoryError(
                        f"request {request.request_id} needs {num_new} tokens of KV cache, more than the pool holds"
                    )
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new

    def _state_taken(self, request: Request) -> bool:
        """A hybrid request's state pages, taken before its KV; False when the pool cannot give them all."""
        return self.states is None or self.states.holds(request.request_id) or self.states.allocate(request.request_id)

    def _free_state(self, request: Request) -> None:
        if self.states is not None and self.states.holds(request.request_id):
            self.states.free(request.request_id)

    def _restored(self, request: Request) -> bool:
        """A request whose KV was saved at preemption gets it back in fresh pages; False when the pool is short."""
        return self.swap is None or not self.swap.holds(request.request_id) or self.swap.restore(request)

    def finish(self, request: Request, reason: str) -> None:
        """Mark a request finished, free its pages and drop it from the queues. Mutates."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if reason != "abort":
            self.forecast.observe_finished(request)
        self.kv_cache.free(request.request_id)
        self._free_state(request)
        if self.swap is not None:
            self.swap.drop(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)


class _Admission:
    """One round's admission checks: the forecast peak of the running batch and the requests admitted so far, kept
    as an upper bound while requests join (each adds at most its own final pages), recomputed exactly only when
    that bound says no."""

    def __init__(self, scheduler: Scheduler):
        self.running, self.forecast = scheduler.running, scheduler.forecast
        self.capacity = scheduler._capacity_pages()
        self.peak = self.forecast.peak_pages(self.running)
        self.lacking = 0  # pages a layer the last refused request lacked
        # a hybrid request's state pages, as KV pages a layer: held from admission to its end, like its final KV
        states, layers = scheduler.states, scheduler.kv_cache.num_layers
        self.state_pages = 0 if states is None else -(-states.kv_pages_per_request() // layers)
        self.num_running = len(self.running)  # requests admitted this round join `running` after these

    def admits(self, request: Request) -> bool:
        """Whether the pool carries `request` too; the bound then counts it, as the caller admits it or stops."""
        final = -(-(request.num_tokens + self.forecast.remaining(request)) // self.forecast.page_tokens)
        if self.peak + final + self.state_pages <= self.capacity:
            self.peak += final + self.state_pages
            return True
        # running requests' states are held already: only the newly admitted ones' count against the capacity
        states = self.state_pages * (len(self.running) - self.num_running + 1)
        self.peak = self.forecast.peak_pages(self.running + [request]) + states
        self.lacking = max(0, self.peak - self.capacity)
        return self.lacking == 0
