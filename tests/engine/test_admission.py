"""The growth forecast against hand-computed cases and a step-by-step simulation of the batch's pages."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru.admission import GrowthForecast, peak_demand, peak_demand_direct
from rimuru.request import Request
from rimuru.sampling_params import SamplingParams


def simulated_peak(tokens: list[int], growth: list[int], page: int) -> int:
    """Walk the batch a step at a time: each request grows by one token until it has grown by its r."""
    peak = 0
    for t in range(max(growth, default=0) + 1):
        peak = max(peak, sum(-(-(c + t) // page) for c, r in zip(tokens, growth) if r >= t))
    return peak


def test_the_peak_comes_just_before_a_request_ends():
    # page 16: a (10 tokens, 30 more) and b (20 tokens, 4 more). At t = 4: a 14 -> 1 page, b 24 -> 2: 3 pages.
    # At t = 30 only a runs: 40 tokens, 3 pages. Peak 3, never the 3 + 2 = 5 of both at their ends together.
    assert peak_demand(np.array([10, 20]), np.array([30, 4]), 16) == 3
    assert peak_demand(np.array([16]), np.array([0]), 16) == 1
    assert peak_demand(np.array([17, 24, 31]), np.array([12, 12, 12]), 16) == 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), min_size=1, max_size=24),
       st.sampled_from([1, 3, 16]))  # fmt: skip
def test_peak_demand_equals_a_step_by_step_simulation(requests, page):
    tokens, growth = [c for c, _ in requests], [r for _, r in requests]
    peak = simulated_peak(tokens, growth, page)
    assert peak_demand(np.array(tokens), np.array(growth), page) == peak
    assert peak_demand_direct(tokens, growth, page) == peak  # the small batches' path


def request(prompt: int, max_tokens: int, generated: int = 0) -> Request:
    r = Request("r", [1] * prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
    r.output_token_ids = [2] * generated
    return r


def test_the_ratio_follows_the_share_of_max_tokens_that_finished_requests_used():
    forecast = GrowthForecast(page_tokens=16)
    assert forecast.remaining(request(5, 100, generated=40)) == 60  # nothing finished yet: the whole allowance
    for _ in range(400):  # outputs that stop at EOS after a quarter of their allowance
        forecast.observe_finished(request(5, 100, generated=25))
    assert abs(forecast.ratio - 0.25) < 1e-4
    assert forecast.remaining(request(5, 100, generated=21)) == 20  # ceil(0.25 * 79)
    assert forecast.remaining(request(5, 100, generated=99)) == 1  # at least one while any is allowed
    assert forecast.remaining(request(5, 100, generated=100)) == 0
    # a: 26 tokens, 20 more; b: 30 tokens, ceil(0.25 * 10) = 3 more. At t = 3: 29 -> 2 pages and 33 -> 3
    assert forecast.peak_pages([request(5, 100, generated=21), request(30, 10)]) == 5


class CountedPages:
    """A page allocator stand-in of `capacity` KV pages that only counts them."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.held = capacity, 0, {}

    def num_free_small_pages(self, kind=None) -> int:
        return self.capacity - self.used

    def allocate(self, owner, count, kind=None):
        if count > self.num_free_small_pages():
            return None
        self.used += count
        self.held[owner] = self.held.get(owner, 0) + count
        return [0] * count

    def free(self, owner) -> None:
        self.used -= self.held.pop(owner, 0)

    def expert_pages_for(self, num_small_pages: int) -> int:
        return num_small_pages


def test_a_refusal_stands_a_few_decode_rounds_without_the_forecast_and_never_preempts(monkeypatch):
    """Two requests decode and a third waits that the forecast refuses: the refusal is recomputed once every
    REFUSAL_ROUNDS rounds (two peak passes each time), not every round; and the whole run never preempts."""
    from rimuru.kv_cache import KVCacheManager
    from rimuru.scheduler import REFUSAL_ROUNDS, Scheduler, SchedulerConfig

    kv = KVCacheManager(CountedPages(12), 1, 16, max_slots=8, max_model_len=1024)
    scheduler = Scheduler(SchedulerConfig(8, 256), kv)
    passes = []
    real = scheduler.forecast.peak_pages
    monkeypatch.setattr(scheduler.forecast, "peak_pages", lambda requests: passes.append(1) or real(requests))
    for i, (prompt, out) in enumerate([(40, 60), (40, 60), (60, 40)]):
        scheduler.add(Request(f"r{i}", [1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True), out))
    rounds = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        for r, n in zip(batch.requests, batch.num_new_tokens):
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens:
                r.output_token_ids.append(2)
                if len(r.output_token_ids) >= r.max_tokens:
                    scheduler.finish(r, "length")
        rounds += 1
        if rounds == 2 + 4 * REFUSAL_ROUNDS:
            refusals, checked = scheduler.num_refusals, len(passes)
    assert refusals >= 4 * REFUSAL_ROUNDS and checked <= 2 * (refusals // REFUSAL_ROUNDS + 2)
    assert scheduler.num_preemptions == 0
