"""The cost-aware adjuster: its rule on hand-computed numbers, hysteresis, online popularity, and the invariant that
it changes speed, never tokens."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru import LLM
from rimuru.cost_adjuster import (
    MAX_NOMINEES,
    CostAdjuster,
    CostThresholds,
    lower_median,
    plan_cost_adjustment,
    plan_swaps,
    profitable_evictions,
)
from rimuru.cost_model import CostModel, copy_seconds, exposed_seconds, kv_pages_freed, touch_probability
from rimuru.expert_ranking import ExpertRanking
from rimuru.popularity import ExpertPopularity
from tests.engine.test_experts import GREEDY, budget_for, run

# share 0.01, 10 tokens x top-2: P(touched) = 1 - 0.99^20 = 0.182093; 1 MB at 1 GB/s -> 0.182093 ms a step
SHARE, TOKENS, TOP_K, EXPERT_BYTES = 0.01, 10, 2, 10**6


def test_touch_probability_and_copy_time_by_hand():
    assert touch_probability(SHARE, TOKENS, TOP_K) == pytest.approx(0.182093, abs=1e-6)
    assert touch_probability(0.0, 1000, 8) == 0.0 and touch_probability(1.0, 1, 1) == 1.0
    assert copy_seconds([SHARE] * 2, TOKENS, TOP_K, EXPERT_BYTES, 1e9) == pytest.approx(2 * 0.182093e-3, rel=1e-5)
    assert kv_pages_freed(2, 3, 4) == 24  # 2 experts x 3 expert pages x 4 KV pages each


def test_cheap_copies_evict():
    """Copies hidden under the compute cost nothing: 1 GB/s, each nominee 0.182 ms, 1 ms of compute hides five
    (0.91 ms); the sixth exposes 0.093 ms, which 20 requests of a 1 ms step pay for only when it admits
    20 x 0.093 / 1 / 6 = 0.31 requests an expert (it admits 0.2 here: five go). Short by 8 pages -> evict 3."""
    marginal = copy_seconds([SHARE], TOKENS, TOP_K, EXPERT_BYTES, 1e9)
    exposed = [exposed_seconds(n * marginal, hidden_s=1e-3) for n in range(7)]
    assert exposed[:6] == [0.0] * 6 and exposed[6] == pytest.approx(6 * 0.182093e-3 - 1e-3, rel=1e-5)
    assert profitable_evictions(1e-3, running=20, requests_per_expert=0.2, exposed_s=exposed) == 5
    assert profitable_evictions(1e-3, running=20, requests_per_expert=0.4, exposed_s=exposed) == 6
    assert plan_cost_adjustment(8, 0, affordable=5, forced=False, free_rounds=0) == (3, 0)
    assert plan_cost_adjustment(8, 0, affordable=2, forced=False, free_rounds=0) == (2, 0)  # as far as it pays


def test_direct_reads_evict_while_the_batch_gains_more_than_the_step():
    """Direct reads hide nothing. A 10 ms step of 20 requests, 0.2 requests an expert: nominees reading 0.05, 0.08,
    0.12 and 0.2 ms more a step. n = 1..4: 2n ms-requests gained against 20 x (0.05, 0.13, 0.25, 0.45) ms lost:
    2 >= 1, 4 >= 2.6, 6 >= 5, 8 < 9 -> three go."""
    link = [0.0, 0.05e-3, 0.13e-3, 0.25e-3, 0.45e-3]
    assert profitable_evictions(10e-3, running=20, requests_per_expert=0.2, exposed_s=link) == 3
    assert profitable_evictions(10e-3, running=20, requests_per_expert=0.2, exposed_s=[x + 1.0 for x in link]) == 3
    assert profitable_evictions(10e-3, running=80, requests_per_expert=0.2, exposed_s=link) == 0  # a big batch
    assert profitable_evictions(10e-3, running=20, requests_per_expert=0.2, exposed_s=[0.0]) == 0  # no nominee
    # a band of 0.5 weighs the cost 1.5x: 2 >= 1.5, 4 >= 3.9, 6 < 7.5 -> two go
    assert profitable_evictions(10e-3, running=20, requests_per_expert=0.2, exposed_s=link, band=0.5) == 2


def test_expensive_copies_refuse():
    """0.1 GB/s: one nominee alone adds 1.82 ms, 0.82 of them past 1 ms of compute; half a ms already offloaded
    leaves less room."""
    marginal = copy_seconds([SHARE], TOKENS, TOP_K, EXPERT_BYTES, 1e8)
    exposed = [exposed_seconds(n * marginal, hidden_s=1e-3) for n in range(2)]
    assert profitable_evictions(1e-3, running=20, requests_per_expert=0.2, exposed_s=exposed) == 0
    hidden_more = [exposed_seconds(n * marginal, hidden_s=2e-3) for n in range(2)]  # the ratio buys slack
    assert profitable_evictions(1e-3, running=20, requests_per_expert=0.2, exposed_s=hidden_more) == 1
    after_half_a_ms = [exposed_seconds(0.9e-3 + n * 0.182093e-3, hidden_s=1e-3) for n in range(2)]
    assert profitable_evictions(1e-3, running=20, requests_per_expert=0.2, exposed_s=after_half_a_ms) == 0
    assert plan_cost_adjustment(8, 0, affordable=0, forced=False, free_rounds=0) == (0, 0)
    assert plan_cost_adjustment(0, 1, affordable=0, forced=False, free_rounds=0) == (0, 0)  # no precaution


def test_a_missed_slo_evicts_despite_the_cost():
    assert plan_cost_adjustment(8, 0, affordable=0, forced=True, free_rounds=0) == (3, 0)


def test_growth_waits_for_pages_to_stay_free():
    t = CostThresholds(grow_after_rounds=3)
    assert plan_cost_adjustment(0, 20, 0, False, free_rounds=2, t=t) == (0, 0)
    assert plan_cost_adjustment(0, 20, 0, False, free_rounds=3, t=t) == (0, 3)  # (20 - 9) // 3
    assert plan_cost_adjustment(0, 9, 0, False, free_rounds=9, t=t) == (0, 0)


def fake_store(offloaded: dict[int, set[int]], layers=(0,), num_experts: int = 4):
    host = {layer: SimpleNamespace(matrices=lambda e: [torch.zeros(250_000)]) for layer in layers}

    def host_mask() -> torch.Tensor:  # as ExpertStore's, from the sets the tests edit
        mask = torch.zeros(len(layers), num_experts, dtype=torch.bool)
        for row, layer in enumerate(layers):
            mask[row, sorted(offloaded[layer])] = True
        return mask

    return SimpleNamespace(host=host, layer_ids=list(layers), copier=SimpleNamespace(take_timings=lambda: (0, 0.0)),
                           offloaded=offloaded, host_mask=host_mask)  # fmt: skip


def test_cost_adjuster_never_bounces_and_slo_overrides():
    """One layer of 4 experts (1 MB each, fp32); ranking 0.4/0.3/0.2/0.1."""
    popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4)
    offloaded = {0: set()}
    t = CostThresholds(grow_after_rounds=2, readd_after_rounds=3, ttft_slo=5.0)
    adjuster = CostAdjuster(popularity, 2, fake_store(offloaded), top_k=1, thresholds=t)
    assert adjuster.adjust(8, 0, offloaded).evict == []  # nothing measured yet: no eviction without force
    adjuster.cost.pin(bandwidth=1e12, compute_s=1.0, tokens_per_step=1.0, running=10.0, kv_pages_per_request=100.0)
    adjuster.refresh()
    assert adjuster.reclaimable_experts(offloaded) == 2
    assert adjuster.adjust(8, 0, offloaded).evict == [(0, 3), (0, 2)]  # coldest first, the cap is 2
    offloaded[0] |= {3, 2}
    rounds = [adjuster.adjust(0, 20, offloaded).add for _ in range(4)]
    assert rounds == [[], [], [(0, 2), (0, 3)], []]  # free twice in a row, and not before 3 rounds out
    adjuster.cost.pin(bandwidth=1.0)  # copies now cost a second a byte: nothing is affordable
    offloaded[0].clear()
    adjuster.refresh()
    assert adjuster.reclaimable_experts(offloaded) == 0 and adjuster.adjust(8, 0, offloaded).evict == []
    adjuster.oldest_wait_s = 6.0  # the oldest waiting request has waited past the 5 s target
    assert adjuster.reclaimable_experts(offloaded) == 2 and len(adjuster.adjust(8, 0, offloaded).evict) == 2
    assert adjuster.adjust(4, 0, offloaded, stalled=True).evict == [(0, 3), (0, 2)]  # nothing else frees pages


def test_evictions_need_a_majority_of_recent_refreshes():
    """Noise near the break-even must not ratchet the split (evictions are one-way while requests wait). A free
    link makes every nominee profitable, a slow one none; refreshes alternate slow, free, slow, ...: with votes
    the host count the lower median agrees on stays put, while each refresh alone (`eviction_votes=1`) lets
    every free one evict. Two free refreshes in three then evict."""
    num_experts = 40

    def evictions(links: list[float], votes: int) -> int:
        popularity = ExpertPopularity(ExpertRanking({0: tuple([1 / num_experts] * num_experts)}), num_experts)
        offloaded = {0: set()}
        t = CostThresholds(eviction_votes=votes)
        adjuster = CostAdjuster(popularity, 30, fake_store(offloaded, num_experts=num_experts), top_k=1, thresholds=t)
        for bandwidth in links:
            adjuster.cost.pin(bandwidth=bandwidth, compute_s=1e-2, tokens_per_step=1.0, running=10.0,
                              kv_pages_per_request=3.0)  # fmt: skip
            adjuster.refresh()
            offloaded[0] |= {expert for _, expert in adjuster.adjust(6, 0, offloaded).evict}  # 3 experts short
        return len(offloaded[0])

    alternating = [1.0, 1e15] * 4
    assert evictions(alternating, votes=1) == 4 * 3 and evictions(alternating, votes=8) == 0
    popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4)
    adjuster = CostAdjuster(popularity, 2, fake_store({0: set()}), top_k=1)
    for bandwidth in (1.0, 1e15):  # the estimates show both: this refresh alone finds 2, the majority none
        adjuster.cost.pin(bandwidth=bandwidth, compute_s=1e-2, tokens_per_step=1.0, running=10.0,
                          kv_pages_per_request=3.0)  # fmt: skip
        adjuster.refresh()
    assert adjuster.estimates["cost_profitable_this_refresh"] == 2
    assert adjuster.estimates["cost_affordable_evictions"] == 0
    assert evictions([1.0, 1e15, 1e15], votes=8) == 3
    assert lower_median([3, 0]) == 0 and lower_median([0, 3, 5]) == 3 and lower_median([math.inf, 2]) == 2


def test_the_ttft_target_reads_the_longest_wait_since_joining_the_queue():
    """The scheduler stamps a request as it joins the waiting queue (and again when preempted); the rule's
    `oldest_wait_s` is the longest of those waits among the requests waiting now, 0 with none."""
    import time

    from rimuru.request import Request
    from rimuru.sampling_params import SamplingParams
    from rimuru.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                          kv_cache=SimpleNamespace(page_tokens=16))  # fmt: skip
    before = time.monotonic()
    scheduler.add(request := Request("a", [1, 2], SamplingParams(), max_tokens=4))
    assert before <= request.waiting_since <= time.monotonic()
    popularity = ExpertPopularity(ExpertRanking({0: (0.5, 0.5)}), 2)
    adjuster = CostAdjuster(popularity, 1, fake_store({0: set()}, num_experts=2), top_k=1,
                            thresholds=CostThresholds(ttft_slo=5.0))  # fmt: skip
    now = time.monotonic()
    waiting = [SimpleNamespace(waiting_since=now - 1.0), SimpleNamespace(waiting_since=now - 6.0)]
    adjuster.observe(0.01, 4, waiting)
    assert adjuster.oldest_wait_s == pytest.approx(6.0, abs=0.5) and adjuster.slo_missed
    adjuster.observe(0.01, 4, waiting[:1])
    assert adjuster.oldest_wait_s == pytest.approx(1.0, abs=0.5) and not adjuster.slo_missed
    adjuster.observe(0.01, 4, [])
    assert adjuster.oldest_wait_s == 0.0


def test_copies_hide_under_the_compute_and_direct_reads_do_not():
    """One layer of 4 experts (1 MB, 1 GB/s: 1 ms a read), one token of top-1, a 10 ms step of 20 requests, 0.1
    requests an expert. The two nominees are touched 0.1 and 0.2 of steps: 0.1 and 0.2 ms. Copied in, both hide
    under the 10 ms of compute: both go. Read in place, the first costs 20 x 0.1 ms against 0.1 x 10 gained: none."""
    def adjuster(reads_in_place):
        popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4)
        made = CostAdjuster(popularity, 2, fake_store({0: set()}), top_k=1, reads_in_place=reads_in_place)
        made.cost.pin(bandwidth=1e9, compute_s=10e-3, tokens_per_step=1.0, running=20.0, kv_pages_per_request=30.0)
        made.refresh()
        return made.estimates

    copied, read = adjuster(None), adjuster(lambda: 0)
    assert copied["cost_requests_per_expert"] == pytest.approx(0.1)
    assert copied["cost_next_eviction_ms"] == pytest.approx(0.1) == read["cost_next_eviction_ms"]
    assert copied["cost_affordable_evictions"] == 2 and read["cost_affordable_evictions"] == 0


def test_a_refresh_weighs_max_nominees_and_the_next_ones_come_before_they_run_out():
    """200 experts, each free to evict (a huge link): a refresh weighs MAX_NOMINEES of them and allows them all;
    once evictions have used up half, the next step's `observe` asks for the next ones at the next pass, not 8 rounds
    later."""
    num_experts = 200
    popularity = ExpertPopularity(ExpertRanking({0: tuple([1 / num_experts] * num_experts)}), num_experts)
    offloaded = {0: set()}
    adjuster = CostAdjuster(popularity, 150, fake_store(offloaded, num_experts=num_experts), top_k=1)
    adjuster.cost.pin(bandwidth=1e15, compute_s=1e-2, tokens_per_step=1.0, running=10.0, kv_pages_per_request=3.0)
    adjuster.refresh()
    assert adjuster.reclaimable_experts(offloaded) == MAX_NOMINEES  # not the cap's 150: the rest is not weighed yet
    evicted = adjuster.adjust(3 * (MAX_NOMINEES // 2 + 1) - 1, 0, offloaded).evict  # short by 33 experts' pages
    assert len(evicted) == MAX_NOMINEES // 2 + 1
    offloaded[0] |= {expert for _, expert in evicted}  # what `end_step` does
    assert adjuster.reclaimable_experts(offloaded) == MAX_NOMINEES // 2 - 1
    adjuster.observe(1e-2, 1, running=10, kv_pages=30)
    assert adjuster.refresh_due and adjuster._unflushed == 1  # no flush
    adjuster.refresh_if_due()  # during the next pass
    assert adjuster.reclaimable_experts(offloaded) == MAX_NOMINEES


def test_a_refresh_during_the_pass_counts_the_rounds_evictions_as_gone():
    """A refresh while the pass runs (`refresh_if_due`) comes before `end_step` evicts what the round chose: it
    must weigh the next experts, not nominate those again. Ranking 0.4/0.3/0.2/0.1, cap 2, a free link: expert 3
    leaves this round, so the refresh weighs expert 2 alone (1 affordable, its share 0.2), as a refresh after
    `end_step` does."""
    popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4)
    offloaded = {0: set()}
    adjuster = CostAdjuster(popularity, 2, fake_store(offloaded), top_k=1, refresh_every=1)
    adjuster.cost.pin(bandwidth=1e9, compute_s=1.0, tokens_per_step=1.0, running=1.0, kv_pages_per_request=1.0)
    adjuster.refresh()
    assert adjuster._affordable == 2 and adjuster.estimates["cost_next_eviction_ms"] == pytest.approx(0.1)
    assert adjuster.adjust(2, 0, offloaded).evict == [(0, 3)]  # short by 2 pages, a cushion of 1: one expert
    adjuster.observe(1.0, 1, running=1, kv_pages=1)
    assert adjuster.refresh_due
    adjuster.refresh_if_due()  # the store still holds expert 3
    during_the_pass = (adjuster._affordable, adjuster.estimates["cost_next_eviction_ms"])
    offloaded[0].add(3)  # what `end_step` does
    adjuster.refresh()
    assert during_the_pass == (adjuster._affordable, adjuster.estimates["cost_next_eviction_ms"])
    assert during_the_pass == (1, pytest.approx(0.2))


def test_the_calibration_only_raises_the_predicted_link_time():
    """Measured link time 3x the prediction scales nominees by 3 (within the cap of 4); measured below the
    prediction leaves them as the touch model says."""
    popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4)
    offloaded = {0: {3}}
    adjuster = CostAdjuster(popularity, 2, fake_store(offloaded), top_k=1)
    adjuster.cost.pin(bandwidth=1e9, compute_s=1.0, tokens_per_step=1.0, running=1.0, kv_pages_per_request=3.0)
    expected = [3.0, 1.0, 4.0]
    for measured, scale in zip((3.0, 0.5, 10.0), expected):
        adjuster.measured_copy_s, adjuster.predicted_copy_s = measured, 1.0
        adjuster.refresh()
        assert adjuster.estimates["cost_calibration"] == scale
        # the next nominee (expert 2, share 0.2, 1 MB at 1 GB/s, one token of top-1): 0.2 ms x the scale
        assert adjuster.estimates["cost_next_eviction_ms"] == pytest.approx(0.2 * scale)


def test_online_popularity_follows_a_shifted_distribution():
    """Half-life 16 steps: 4 half-lives (64 steps) after the shift, old routings weigh 1/16 and the learned shares
    are within 0.1 (total variation) of the new distribution."""
    old = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
    new = old.flip(0)
    popularity = ExpertPopularity(ExpertRanking({0: tuple(old.tolist())}), 8, half_life_steps=16, prior_routings=64)
    assert popularity.hottest_first(0) == [0, 1, 2, 3, 4, 5, 6, 7]  # seeded by the offline ranking
    generator = torch.Generator().manual_seed(0)

    def steps(distribution: torch.Tensor, count: int) -> None:
        for _ in range(count):  # 64 tokens x top-2 a step
            popularity.record(
                0, torch.multinomial(distribution, 128, replacement=True, generator=generator).view(64, 2)
            )
            popularity.flush()

    def distance(target: torch.Tensor) -> float:
        return 0.5 * (torch.tensor(popularity.probabilities(0)) - target).abs().sum().item()

    steps(old, 200)
    assert distance(old) < 0.05 and distance(new) > 0.5
    steps(new, 64)
    assert distance(new) < 0.1
    assert popularity.hottest_first(0)[:3] == [7, 6, 5]


def cost_run(folder, prompts, bandwidth, **options):
    """`run` with the cost adjuster, copies pinned at `bandwidth` bytes/s and a second of compute a step (host
    experts copied in unless `options` say expert_reads="direct")."""
    def pin(engine):
        engine.adjuster.cost.pin(bandwidth=bandwidth, compute_s=1.0)
        engine.adjuster.thresholds = replace(engine.adjuster.thresholds, grow_after_rounds=2, readd_after_rounds=4)

    return run(folder, prompts, prepare=pin, adjuster="cost", **{"expert_reads": "copy", **options})


def test_cost_adjuster_changes_speed_never_tokens(family):
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    cheap, tokens = cost_run(folder, prompts, bandwidth=1e15, gpu_memory_budget=budget, expert_offload_limit=3)
    stats = cheap.expert_stats
    assert stats["evictions"] > 0 and stats["additions"] > 0 and stats["cost_measured"] == 1
    assert {"cost_predicted_copy_ms", "cost_measured_copy_ms", "cost_touch_p_mean"} <= stats.keys()
    assert tokens == expected
    dear, tokens = cost_run(folder, prompts, bandwidth=1.0, gpu_memory_budget=budget, expert_offload_limit=3)
    assert dear.expert_stats["cost_affordable_evictions"] == 0
    assert dear.expert_stats["evictions"] < stats["evictions"]  # only when stalled: preempting beats copying
    assert tokens == expected
    resident, tokens = run(folder, prompts, expert_policy="resident", adjuster="cost")
    assert tokens == expected and resident.expert_stats["offloaded_experts"] == 0
    direct, tokens = cost_run(folder, prompts, bandwidth=1e15, gpu_memory_budget=budget, expert_offload_limit=3,
                              expert_reads="direct")  # fmt: skip
    assert direct.expert_stats["evictions"] > 0 and direct.expert_stats["direct_reads"] > 0
    assert tokens == expected
    slow_link, tokens = cost_run(folder, prompts, bandwidth=1.0, gpu_memory_budget=budget, expert_offload_limit=3,
                                 expert_reads="direct")  # fmt: skip
    assert slow_link.expert_stats["cost_affordable_evictions"] == 0  # reads in place hide under nothing
    assert slow_link.expert_stats["evictions"] < direct.expert_stats["evictions"]
    assert tokens == expected


@pytest.mark.parametrize("bandwidth", [1e15, 1.0])
def test_the_cost_rule_starts_and_serves_where_the_experts_do_not_fit(family, bandwidth):
    """A budget 4 experts short of the weights: elastic starts with the coldest on the host, and the cost rule then
    serves the same tokens whether evictions are free or every read costs a second (then only a stalled round, one
    request running, evicts)."""
    folder, prompts, expected = family
    engine = LLM(folder, progress=False, expert_policy="resident").engine
    expert_bytes = 3 * engine.pool.sizes.expert_page_bytes
    del engine
    budget = budget_for(folder, kv_tokens=60, offload=0) - 4 * expert_bytes  # direct reads: no loading buffers
    engine, tokens = cost_run(folder, prompts, bandwidth, gpu_memory_budget=budget, expert_offload_limit=3,
                              expert_reads="direct")  # fmt: skip
    stats = engine.expert_stats
    assert stats["offloaded_experts"] >= 4 and stats["direct_reads"] > 0
    assert stats["cost_affordable_evictions"] == 0 or bandwidth > 1.0
    assert tokens == expected


def test_with_direct_reads_the_measured_cost_is_the_reads_counted(family):
    """Direct reads copy nothing per step: the measured side of the cost model is the host reads the manager counted,
    an expert's bytes each over the measured bandwidth (3 reads a step of E bytes at 1 GB/s: 3E / 1e9 s)."""
    folder = family[0]
    llm = LLM(folder, progress=False, gpu_memory_budget=budget_for(folder, 60, 3), expert_offload_limit=3,
              adjuster="cost", expert_reads="direct")  # fmt: skip
    adjuster = llm.engine.adjuster
    assert adjuster.reads_in_place() == llm.engine.expert_manager.direct_reads()  # none yet (one read late or not)
    adjuster.cost.pin(bandwidth=1e9, compute_s=1.0)
    reads = [adjuster._reads_seen]
    adjuster.reads_in_place = lambda: reads[0]
    for _ in range(2 * adjuster.refresh_every):
        reads[0] += 3
        adjuster.observe(0.01, 4, running=2, kv_pages=20)
        adjuster.refresh_if_due()
    expected_ms = 3 * adjuster.expert_bytes / 1e9 * 1e3
    assert adjuster.estimates["cost_measured_copy_ms"] == pytest.approx(expected_ms)


@pytest.mark.parametrize("reads", ["copy", "direct"])
@pytest.mark.parametrize("cuda_graphs", [False, True])  # True on CPU: the graphs' padded path, run eagerly
def test_online_popularity_counts_every_routing_the_hook_sees(family, reads, cuda_graphs):
    """Under the cost rule the routing hook adds its routed counts to the online popularity (copies, with experts
    on the host), the counting hook does (direct reads, or nothing on the host), or the step graphs' pass counts
    itself (`RoutingCounter.count_pass`, padding rows left out): either way every routing is counted once, as an
    observer sees it."""
    folder, prompts, expected = family
    seen, flushed = {}, []

    def prepare(engine):
        popularity = engine.adjuster.popularity
        flush = popularity.flush

        def counting_flush(num_steps=1):
            flushed.append(popularity.pending.clone())
            flush(num_steps)

        popularity.flush = counting_flush
        engine.expert_manager.counter.observers.append(
            lambda layer, hidden, ids: seen.__setitem__(layer, seen.get(layer, 0) + torch.bincount(ids.flatten(),
                                                         minlength=popularity.num_experts)))  # fmt: skip
        prepare.popularity = popularity

    budget = budget_for(folder, kv_tokens=60, offload=3)
    engine, tokens = run(folder, prompts, prepare=prepare, adjuster="cost", gpu_memory_budget=budget,
                         expert_offload_limit=3, expert_reads=reads, cuda_graphs=cuda_graphs)  # fmt: skip
    popularity = prepare.popularity
    counted = sum(flushed) + popularity.pending
    assert tokens == expected and engine.expert_stats["offloaded_experts"] > 0
    for layer, row in popularity.row.items():
        assert torch.equal(counted[row], seen[layer]), f"layer {layer}"


def test_plan_swaps_by_hand():
    host = {0: {5: 0.30, 6: 0.15}, 1: {2: 0.05}}
    resident = {0: {0: 0.40, 1: 0.10, 2: 0.05}, 1: {0: 0.5, 1: 0.45}}
    # layer 0: 0.30 vs the coldest 0.05 (gain 0.25), then 0.15 vs 0.10: under 2x, stop; layer 1: 0.05 vs 0.45, no
    assert plan_swaps(host, resident, margin=2.0, max_swaps=4) == [(0, 2, 5)]
    assert plan_swaps(host, resident, margin=1.2, max_swaps=4) == [(0, 2, 5), (0, 1, 6)]
    assert plan_swaps(host, resident, margin=1.2, max_swaps=1) == [(0, 2, 5)]  # largest gain first
    assert plan_swaps({0: {}}, {0: {0: 1.0}}, 2.0, 2) == []


def test_a_swap_must_repay_its_copy():
    """Shares 0.003 on the host against 0.001 resident (3x): one token of top-1 touches them 0.003 and 0.001 times a
    step, 0.002 saved, under the 1/64 a swap settled for 64 rounds must save; 100 tokens of top-4 touch them
    1 - 0.997^400 = 0.699 and 1 - 0.999^400 = 0.330 times, 0.369 saved: swap."""
    host, resident = {0: {5: 0.003}}, {0: {0: 0.001}}
    one_token = lambda p: touch_probability(p, 1, 1)  # noqa: E731
    batch = lambda p: touch_probability(p, 100, 4)  # noqa: E731
    assert batch(0.003) - batch(0.001) == pytest.approx(0.369, abs=1e-3)
    assert plan_swaps(host, resident, 2.0, 2, one_token, min_touch_gain=1 / 64) == []
    assert plan_swaps(host, resident, 2.0, 2, batch, min_touch_gain=1 / 64) == [(0, 0, 5)]


def test_swaps_follow_a_shifted_popularity_and_never_bounce():
    """Offline ranking 0.4/0.3/0.2/0.1 with expert 3 on the host; the traffic then moves to expert 3 alone."""
    popularity = ExpertPopularity(ExpertRanking({0: (0.4, 0.3, 0.2, 0.1)}), 4, half_life_steps=4, prior_routings=16)
    offloaded = {0: {3}}
    t = CostThresholds(readd_after_rounds=5, max_swaps_per_round=1)
    adjuster = CostAdjuster(popularity, 2, fake_store(offloaded), top_k=1, thresholds=t)
    assert adjuster.adjust(0, 5, offloaded).swap == []  # nothing measured: no batch size to weigh a swap against
    adjuster.cost.pin(tokens_per_step=64.0)
    assert adjuster.adjust(0, 5, offloaded).swap == []  # the offline order holds: 0.1 is below 2 x 0.2
    for _ in range(8):
        popularity.record(0, torch.full((64, 1), 3))
    popularity.flush(8)
    changes = adjuster.adjust(0, 5, offloaded)
    assert changes.swap == [(0, 2, 3)] and changes.evict == [] and changes.add == []  # coldest resident goes
    offloaded[0] = {2}
    for _ in range(8):
        popularity.record(0, torch.full((64, 1), 2))  # and straight back to expert 2
    popularity.flush(8)
    # expert 2 cools for 5 rounds after its eviction; then the coldest resident (expert 1, 0.3 of the old counts)
    assert [adjuster.adjust(0, 5, offloaded).swap for _ in range(5)] == [[], [], [], [], [(0, 1, 2)]]
    assert adjuster.adjust(8, 0, offloaded).swap == []  # short of pages: no swap


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_swaps_read_only_each_layers_ends_and_find_what_the_full_lists_find(data):
    """`CostAdjuster._swaps` hands `plan_swaps` only the hottest host and coldest resident experts a layer can pair
    (ties included); on random shares (many tied), placements and cooling it returns what all of them give."""
    num_layers, num_experts = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 8))
    levels = st.sampled_from([0.01, 0.02, 0.05, 0.1, 0.3])  # few values: ties
    shares = {layer: data.draw(st.lists(levels, min_size=num_experts, max_size=num_experts))
              for layer in range(num_layers)}  # fmt: skip
    ranking = ExpertRanking({layer: tuple(v / sum(row) for v in row) for layer, row in shares.items()})
    offloaded = {layer: set(data.draw(st.lists(st.integers(0, num_experts - 1), max_size=num_experts)))
                 for layer in range(num_layers)}  # fmt: skip
    t = CostThresholds(swap_margin=data.draw(st.sampled_from([1.0, 1.5, 2.0])), max_swaps_per_round=data.draw(
        st.integers(1, 3)), readd_after_rounds=4, swap_min_touch_gain=-1.0)
    popularity = ExpertPopularity(ranking, num_experts)
    adjuster = CostAdjuster(popularity, num_experts, fake_store(offloaded, range(num_layers), num_experts),
                           top_k=1, thresholds=t)  # fmt: skip
    adjuster.cost.pin(tokens_per_step=4.0)
    adjuster.round = 10
    for layer in range(num_layers):  # some experts still cooling or settling
        for expert in data.draw(st.lists(st.integers(0, num_experts - 1), max_size=2)):
            adjuster.evicted_at[(layer, expert)] = data.draw(st.sampled_from([2, 8]))
    share = popularity.probabilities
    movable = {(layer, e) for layer in range(num_layers) for e in range(num_experts)
               if not adjuster._cooling(layer, e)}  # fmt: skip
    host = {layer: {e: share(layer)[e] for e in experts if (layer, e) in movable}
            for layer, experts in offloaded.items() if experts}  # fmt: skip
    resident = {layer: {e: share(layer)[e] for e in range(num_experts) if e not in offloaded[layer]
                        and (layer, e) in movable} for layer in host}  # fmt: skip
    expected = plan_swaps(host, resident, t.swap_margin, t.max_swaps_per_round, min_touch_gain=-1.0)
    assert adjuster._swaps(offloaded) == expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_refresh_weighs_the_experts_the_eviction_order_nominates(data):
    """`CostAdjuster._nominee_costs` (tensor operations over [L, E]) gives the link seconds of the experts
    `Adjuster.eviction_order` nominates, in its order, on random shares (many tied), placements and caps."""
    import itertools

    num_layers, num_experts = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 40))
    levels = st.sampled_from([0.01, 0.02, 0.05, 0.1, 0.3])  # few values: ties
    ranking = ExpertRanking({layer: tuple(v / sum(row) for v in row) for layer, row in {
        layer: data.draw(st.lists(levels, min_size=num_experts, max_size=num_experts)) for layer in range(num_layers)
    }.items()})  # fmt: skip
    offloaded = {layer: set(data.draw(st.lists(st.integers(0, num_experts - 1), max_size=num_experts)))
                 for layer in range(num_layers)}  # fmt: skip
    limit = data.draw(st.integers(0, num_experts))
    store = fake_store(offloaded, range(num_layers), num_experts)
    adjuster = CostAdjuster(ExpertPopularity(ranking, num_experts), limit, store, top_k=2)
    adjuster.cost.pin(bandwidth=1e9, tokens_per_step=8.0)
    link_s = adjuster.expert_bytes / 1e9
    nominees = itertools.islice(adjuster.nominator.eviction_order(offloaded), MAX_NOMINEES)
    expected = [link_s * touch_probability(adjuster.popularity.share(*key), 8.0, 2) for key in nominees]
    assert adjuster._nominee_costs(store.host_mask(), 1.0) == pytest.approx(expected, rel=1e-12)


def test_swaps_change_speed_never_tokens(family):
    """Swaps forced every third round in a run that also evicts, adds and misses: the same tokens."""
    folder, prompts, expected = family

    def force_swaps(engine):
        adjust, rounds = engine.adjuster.adjust, [0]

        def adjust_and_swap(short, free, offloaded, stalled=False):
            changes, rounds[0] = adjust(short, free, offloaded, stalled), rounds[0] + 1
            evicted = {key for key in changes.evict}
            layers = [layer for layer, experts in offloaded.items() if experts]
            if rounds[0] % 3 == 0 and layers and not changes.add:
                layer = layers[rounds[0] % len(layers)]
                resident = [e for e in range(engine.experts.num_experts)
                            if e not in offloaded[layer] and (layer, e) not in evicted]  # fmt: skip
                changes.swap = [(layer, resident[0], min(offloaded[layer]))]
            return changes

        engine.adjuster.adjust = adjust_and_swap

    budget = budget_for(folder, kv_tokens=60, offload=3)
    engine, tokens = run(folder, prompts, prepare=force_swaps, gpu_memory_budget=budget, expert_offload_limit=3,
                         expert_reads="copy")  # fmt: skip
    stats = engine.expert_stats
    assert stats["swaps"] > 0 and stats["evictions"] > 0 and stats["prefetch_misses"] > 0
    assert tokens == expected


def test_after_a_shift_swaps_bring_the_new_favourites_back_and_the_offline_ranking_does_not(tmp_path):
    """Dummy weights whose two vocabulary halves favour different experts, a ranking profiled on the first half, then
    traffic from the second half only: the cost adjuster's online popularity and swaps end with none of the second
    half's three favourites of any layer on the host; the paper's rule, ordering by the offline ranking, keeps some
    there. Tokens stay those of all-resident."""
    import json
    import random

    from rimuru.models.dummy import regime_rows
    from rimuru.models.fabricate import tiny_config
    from rimuru.profiler import profile_experts

    json.dump(tiny_config("qwen3_moe") | {"num_experts": 16}, open(tmp_path / "config.json", "w"))
    common = dict(load_format="dummy", router_skew=2.0, router_regimes=2, progress=False, expert_reads="copy")
    first, second = regime_rows(512, 2)
    rng = random.Random(0)

    def prompts(half, count):
        return [[rng.randrange(half.start, half.stop) for _ in range(rng.randint(8, 30))] for _ in range(count)]

    resident = LLM(tmp_path, expert_policy="resident", **common)
    profile_experts(resident.engine, prompts(first, 16), max_tokens=8).save(tmp_path / "ranking.json")
    shifted = profile_experts(LLM(tmp_path, expert_policy="resident", **common).engine, prompts(second, 16), 8)
    favourites = {layer: set(shifted.hottest_first(layer)[:3]) for layer in shifted.shares}
    engine = resident.engine
    pages = engine.experts.num_expert_pages * 3 // 4 + 2 * 6 * 3 + 16  # a quarter of the experts must leave
    budget = engine.memory_plan.weights_bytes + engine.memory_plan.activation_bytes
    budget += pages * engine.pool.sizes.expert_page_bytes
    traffic = prompts(second, 24)
    expected = [o.outputs[0].token_ids for o in resident.generate(traffic, GREEDY, use_tqdm=False)]
    on_host = {}
    for adjuster in ("cost", "paper"):
        llm = LLM(tmp_path, expert_policy="elastic", adjuster=adjuster, expert_offload_limit=6, gpu_memory_budget=budget,
                  expert_ranking=str(tmp_path / "ranking.json"), **common)  # fmt: skip
        if adjuster == "cost":
            llm.engine.adjuster.cost.pin(bandwidth=1e15, compute_s=1.0)
            llm.engine.adjuster.thresholds = replace(llm.engine.adjuster.thresholds, readd_after_rounds=8)
        assert any(favourites[layer] & experts for layer, experts in llm.engine.experts.offloaded.items())
        tokens = [o.outputs[0].token_ids for o in llm.generate(traffic, GREEDY, use_tqdm=False)]
        assert tokens == expected
        on_host[adjuster] = sum(len(favourites[layer] & e) for layer, e in llm.engine.experts.offloaded.items())
        if adjuster == "cost":
            assert llm.engine.expert_stats["swaps"] > 0
    assert on_host["cost"] == 0 < on_host["paper"]


def test_routing_kept_for_counting_stays_bounded_without_end_step(family):
    """A caller that runs the counting hook pass after pass without `end_step` (a benchmark of the hook): the kept
    ids are counted every few passes, none lost, none kept without end."""
    folder = family[0]
    manager = LLM(folder, progress=False, adjuster="cost").engine.expert_manager
    counter = manager.counter
    popularity, layers = counter.popularity, counter.moe_layers
    ids = torch.tensor([[0, 1], [1, 2]])
    before = popularity.pending.clone()
    for _ in range(10):
        for layer in layers:
            counter.see(layer, torch.zeros(2, 4), ids)
    assert len(counter._pass_ids) <= 4 * len(layers)
    manager.end_step()
    added = popularity.pending - before  # [L, E]: each pass counted experts 0 and 2 once and expert 1 twice
    assert added[:, :3].tolist() == [[10, 20, 10]] * len(layers) and added[:, 3:].sum() == 0


def test_prefill_heavy_steps_leave_the_decode_model_unmeasured():
    """A warm-up of 8 requests prefilling 1,752 tokens in 24 ms is not a decode step: counted, it said 8 requests
    per 24 ms and made every eviction look profitable. A decode step of 30 requests is counted."""
    model = CostModel()
    model.observe_step(0.024, 1752, running=8, kv_pages=80)
    assert model.compute_s is None and model.running is None
    model.observe_step(0.010, 31, running=30, kv_pages=300)
    assert (model.compute_s, model.tokens_per_step, model.running, model.kv_pages_per_request) == (0.010, 31.0, 30.0, 10.0)


def test_the_batch_figures_are_the_last_steps_not_a_warm_ups():
    """Seen on the H200 (flat routing, 200 requests at once): a warm-up's decode steps of 6 requests still held the
    averages when 65 ran, so a nominee touched by 65 x 4 routings (0.33 ms to read) was weighed as if by 14 x 4
    (0.17 ms) against a batch of 6.5, and 31 experts left. The batch's figures are the last step's."""
    model = CostModel()
    for _ in range(20):
        model.observe_step(0.008, 6, running=6, kv_pages=600)
    model.observe_step(0.011, 65, running=65, kv_pages=18_720)
    assert (model.running, model.tokens_per_step, model.kv_pages_per_request) == (65.0, 65.0, 288.0)
    assert 0.008 < model.compute_s < 0.011  # timings stay averages
    gained = kv_pages_freed(1, 3, 44) / model.kv_pages_per_request  # 132 / 288 = 0.46 requests an expert
    read_s = 17.3e6 / 53e9  # one Qwen1.5-MoE expert over the host link
    costs = [n * read_s * touch_probability(1 / 60, model.tokens_per_step, 4) for n in range(4)]
    assert profitable_evictions(model.compute_s, model.running, gained, costs) == 0
    stale = [n * read_s * touch_probability(1 / 60, 13.7, 4) for n in range(4)]
    assert profitable_evictions(model.compute_s, 6.5, gained, stale) == 3  # what the averages had said
