"""`PoolAdjuster`: what the engine asks of an adjuster each round, and `build_adjuster`, the one place that picks it.

Both rules implement it: the paper's (`rimuru.adjuster.Adjuster`, whose after-the-pass parts do nothing) and the
cost rule (`rimuru.cost_adjuster.CostAdjuster`). The engine hands each method what the round measured (the
shortfall, the free pages, whether the batch is stalled, the step's time) and never asks which rule it holds.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from rimuru.adjuster import Adjuster, ChangeList
from rimuru.cost_adjuster import CostAdjuster, CostThresholds
from rimuru.expert_ranking import ExpertRanking
from rimuru.popularity import ExpertPopularity


class PoolAdjuster(Protocol):
    estimates: dict[str, float]  # the rule's model of why the pool moved, for metrics ({} for the paper's)

    def reclaimable_experts(self, offloaded: dict[int, set[int]], stalled: bool = False) -> int: ...

    def adjust(self, short_pages: int, free_pages: int, offloaded: dict[int, set[int]],
               stalled: bool = False) -> ChangeList: ...  # fmt: skip

    def observe(self, step_seconds: float, num_tokens: int, waiting: Sequence = (), running: int = 0,
                kv_pages: int = 0) -> None: ...  # fmt: skip

    def refresh_if_due(self) -> None: ...


def build_adjuster(rule: str, ranking: ExpertRanking, offload_limit: int, popularity: ExpertPopularity | None,
                   store, top_k: int, thresholds: CostThresholds, reads_in_place: Callable[[], int] | None,
                   kv_pages_per_expert_page: int) -> PoolAdjuster:  # fmt: skip
    """The elastic policy's adjuster: "cost" (it needs the live `popularity`) or "paper" (the start-up ranking)."""
    if rule == "paper":
        return Adjuster(ranking, offload_limit)
    return CostAdjuster(popularity, offload_limit, store, top_k, thresholds, reads_in_place=reads_in_place,
                        kv_pages_per_expert_page=kv_pages_per_expert_page)  # fmt: skip
