"""The adjuster: once a round, how many experts leave or rejoin the pool, and which (DESIGN.md section 4).

`plan_adjustment` is the paper's rule as a pure function of the pages the scheduler is short of and the free
expert pages. `Adjuster` turns the counts into experts by the hot-expert ranking: to shrink, each layer below
its offload limit nominates the coldest expert it keeps and the coldest nominee goes first; to grow, each layer
nominates its hottest offloaded expert and the hottest nominee goes first.
"""

import heapq
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
        order = {layer: self.ranking.hottest_first(layer) for layer in offloaded}
        kept = {layer: [e for e in order[layer] if e not in offloaded[layer]] for layer in offloaded}
        budget = {layer: self.offload_limit - len(offloaded[layer]) for layer in offloaded}
        heap = [(self.ranking.share(layer, kept[layer][-1]), layer) for layer in offloaded if budget[layer] > 0 and kept[layer]]
        heapq.heapify(heap)
        chosen = []
        while heap and len(chosen) < count:
            _, layer = heapq.heappop(heap)
            chosen.append((layer, kept[layer].pop()))
            budget[layer] -= 1
            if budget[layer] > 0 and kept[layer]:
                heapq.heappush(heap, (self.ranking.share(layer, kept[layer][-1]), layer))
        return chosen

    def nominate_additions(self, count: int, offloaded: dict[int, set[int]]) -> list[tuple[int, int]]:
        """Up to `count` offloaded experts, hottest nominee first."""
        waiting = {layer: [e for e in self.ranking.hottest_first(layer) if e in offloaded[layer]] for layer in offloaded}
        heap = [(-self.ranking.share(layer, w[0]), layer) for layer, w in waiting.items() if w]
        heapq.heapify(heap)
        chosen = []
        while heap and len(chosen) < count:
            _, layer = heapq.heappop(heap)
            chosen.append((layer, waiting[layer].pop(0)))
            if waiting[layer]:
                heapq.heappush(heap, (-self.ranking.share(layer, waiting[layer][0]), layer))
        return chosen
