"""The adjuster: once a round, how many experts leave or rejoin the pool, and which
(docs/architecture.md, The adjuster).

`plan_adjustment` is the paper's rule as a pure function of the pages the scheduler is short of and the free
expert pages. `Adjuster` turns the counts into experts by the hot-expert ranking: to shrink, each layer below
its offload limit nominates the coldest expert it keeps and the coldest nominee goes first; to grow, each layer
nominates its hottest offloaded expert and the hottest nominee goes first.
"""

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rimuru.expert_ranking import ExpertRanking


@dataclass(frozen=True)
class AdjusterThresholds:
    evict_below_free: int = 2  # not short but fewer free expert pages than this: evict one as a precaution
    add_above_free: int = 9  # more free expert pages than this: bring experts back
    max_add_per_round: int = 5
    cushion_pages: int = 1  # evicting for a shortfall frees this many pages more than asked
    pages_per_expert: int = 3


def plan_adjustment(short_pages: int, free_pages: int, t: AdjusterThresholds = AdjusterThresholds()) -> tuple[int, int]:
    """(experts to evict, experts to add). Short by 8 -> (3, 0); 1 free -> (1, 0); 20 free -> (0, 3); 2..9 free -> (0, 0)."""
    if short_pages > 0:
        return -(-(short_pages + t.cushion_pages) // t.pages_per_expert), 0
    if free_pages < t.evict_below_free:
        return 1, 0
    if free_pages > t.add_above_free:
        return 0, min(t.max_add_per_round, (free_pages - t.add_above_free) // t.pages_per_expert)
    return 0, 0


@dataclass
class ChangeList:
    evict: list[tuple[int, int]] = field(default_factory=list)  # (layer, expert), coldest first
    add: list[tuple[int, int]] = field(default_factory=list)  # (layer, expert), hottest first
    # (layer, resident expert out, host expert in): after the pass the one leaves and the other is copied into its
    # pages, so the pool split stays as it is (the cost adjuster's answer to a shifted workload)
    swap: list[tuple[int, int, int]] = field(default_factory=list)


class Adjuster:
    def __init__(self, ranking: ExpertRanking, offload_limit: int, thresholds: AdjusterThresholds = AdjusterThresholds()):
        self.ranking, self.offload_limit, self.thresholds = ranking, offload_limit, thresholds
        self.estimates: dict[str, float] = {}  # the paper's rule models nothing (`PoolAdjuster`)

    def observe(self, step_seconds: float, num_tokens: int, waiting=(), running: int = 0, kv_pages: int = 0) -> None:
        """The paper's rule learns nothing from a step."""

    def refresh_if_due(self) -> None:
        """Nothing to refresh."""

    def reclaimable_experts(self, offloaded: dict[int, set[int]], stalled: bool = False) -> int:
        """Experts this round may still evict: every one under the offload limit (the paper ignores cost). Pure."""
        return self.offload_limit * len(offloaded) - sum(map(len, offloaded.values()))

    def adjust(self, short_pages: int, free_pages: int, offloaded: dict[int, set[int]],
               stalled: bool = False) -> ChangeList:  # fmt: skip
        """The experts to evict and to add this round, given each layer's offloaded experts. Does not mutate."""
        num_evict, num_add = plan_adjustment(short_pages, free_pages, self.thresholds)
        return ChangeList(evict=self.nominate_evictions(num_evict, offloaded), add=self.nominate_additions(num_add, offloaded))

    def nominate_evictions(self, count: int, offloaded: dict[int, set[int]]) -> list[tuple[int, int]]:
        """Up to `count` resident experts, coldest nominee first; layers at the offload limit are left out."""
        if count <= 0:
            return []  # most rounds: no layer's ranking is walked
        return list(itertools.islice(self.eviction_order(offloaded), max(count, 0)))

    def nominate_additions(self, count: int, offloaded: dict[int, set[int]],
                           held: Callable[[int, int], bool] | None = None) -> list[tuple[int, int]]:  # fmt: skip
        """Up to `count` offloaded experts, hottest nominee first, skipping those `held(layer, expert)` keeps out
        (asked only of the experts the walk reaches)."""
        waiting = {layer: _in(self.ranking.hottest_first(layer), on_host, layer, held)
                   for layer, on_host in offloaded.items() if on_host and count > 0}  # fmt: skip
        return list(itertools.islice(self._merged(waiting, None, lambda share: -share), max(count, 0)))

    def eviction_order(self, offloaded: dict[int, set[int]]) -> Iterator[tuple[int, int]]:
        """Every resident expert the offload limit lets go, coldest nominee first, generated lazily: each layer's
        ranking is walked from its cold end only as far as the caller reads."""
        budget = {layer: self.offload_limit - len(on_host) for layer, on_host in offloaded.items()}
        kept = {layer: _not_in(reversed(self.ranking.hottest_first(layer)), offloaded[layer])
                for layer in offloaded if budget[layer] > 0}  # fmt: skip
        return self._merged(kept, budget, lambda share: share)

    def _merged(self, nominees: dict, budget: dict[int, int] | None, key) -> Iterator[tuple[int, int]]:
        """Merge the layers' nominee iterators: each time the nominee with the smallest key(share), ties to the
        lower layer, until the nominees (or a layer's budget) run out."""
        heap = []

        def push(layer: int) -> None:
            expert = next(nominees[layer], None)
            if expert is not None:
                heapq.heappush(heap, (key(self.ranking.share(layer, expert)), layer, expert))

        for layer in nominees:
            push(layer)
        while heap:
            _, layer, expert = heapq.heappop(heap)
            yield layer, expert
            if budget is not None:
                budget[layer] -= 1
            if budget is None or budget[layer] > 0:
                push(layer)


def _not_in(experts, on_host: set[int]):
    return (e for e in experts if e not in on_host)


def _in(experts, on_host: set[int], layer: int, held: Callable[[int, int], bool] | None):
    return (e for e in experts if e in on_host and not (held and held(layer, e)))
