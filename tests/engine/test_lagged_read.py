"""`LaggedRead` and the reads built on it under async scheduling: each read returns the copy the read before made, so
the host never waits for a pass still queued; nothing counted is lost, only seen one read late."""

import pytest
import torch

from rimuru import LLM
from rimuru.expert_ranking import ExpertRanking
from rimuru.lagged_read import LaggedRead
from rimuru.popularity import ExpertPopularity
from tests.engine.test_experts import budget_for


def test_each_take_returns_the_copy_of_the_take_before():
    source = torch.tensor([1, 2])
    read = LaggedRead(source)
    assert read.take() is None
    source += 10
    assert read.take().tolist() == [1, 2]
    assert read.take().tolist() == [11, 12]


def test_increments_are_zeroed_behind_each_copy_and_none_is_lost():
    source = torch.tensor([3])
    read = LaggedRead(source, zero_after_copy=True)
    assert read.take() is None and source.item() == 0
    source += 5
    assert read.take().item() == 3 and source.item() == 0
    assert read.take().item() == 5


def test_a_lagged_popularity_adds_the_counts_one_flush_late():
    """Two experts, no prior weight, no decay to speak of: the first flush adds nothing, the second the first's."""
    ranking = ExpertRanking({0: (0.5, 0.5)})
    lagged = ExpertPopularity(ranking, 2, half_life_steps=1e12, prior_routings=0.0, lagged=True)
    at_once = ExpertPopularity(ranking, 2, half_life_steps=1e12, prior_routings=0.0)
    for popularity in (lagged, at_once):
        popularity.record(0, torch.tensor([[0], [0], [0], [1]]))
        popularity.flush()
    assert lagged.counts.tolist() == [[0.0, 0.0]] and at_once.counts.tolist() == [[3.0, 1.0]]
    assert lagged.share(0, 0) == 0.5  # nothing seen yet: uniform
    lagged.record(0, torch.tensor([[1]]))
    lagged.flush()
    assert lagged.counts.tolist() == [[3.0, 1.0]] and lagged.share(0, 0) == 0.75


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_cost_rule_reads_direct_reads_one_read_late_only_under_async_scheduling(family, async_scheduling):
    folder = family[0]
    llm = LLM(folder, progress=False, gpu_memory_budget=budget_for(folder, 60, 3), expert_offload_limit=3,
              adjuster="cost", expert_reads="direct", async_scheduling=async_scheduling)  # fmt: skip
    with llm:
        adjuster, counter = llm.engine.adjuster, llm.engine.expert_manager.counter
        counter._direct_reads += 7  # as if a pass had read seven host experts in place
        first = adjuster.reads_in_place()
        counter._direct_reads += 2
        assert (first, adjuster.reads_in_place()) == ((0, 7) if async_scheduling else (7, 9))
        assert counter.direct_reads() == 9  # the records' exact read
        assert adjuster.popularity._lagged is not None if async_scheduling else adjuster.popularity._lagged is None


def test_each_lagged_reader_keeps_its_own_copy(family):
    """Two readers never share a copy: one's read never waits behind a copy the other issued after a pass."""
    llm = LLM(family[0], progress=False, expert_policy="resident", expert_reads="direct")
    with llm:
        counter = llm.engine.expert_manager.counter
        first, second = counter.lagged_direct_reads(), counter.lagged_direct_reads()
        assert first() == 0
        counter._direct_reads += 4
        assert (second(), first(), first(), second()) == (4, 0, 4, 4)
