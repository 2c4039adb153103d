"""Which recovery a preempted request gets: the rule on hand-computed numbers."""

import pytest

from rimuru.preemption_cost import PreemptionCost, recompute_seconds, swap_seconds


def test_the_two_costs_by_hand():
    assert swap_seconds(50 * 10**6, 50e9) == pytest.approx(2e-3)  # 50 MB out and back at 50 GB/s
    assert recompute_seconds(400, 25e-6) == pytest.approx(10e-3)  # 400 tokens at 25 us each


def test_a_victim_is_swapped_until_both_rates_are_measured():
    cost = PreemptionCost()
    assert cost.swap_is_cheaper(10**12, 1)
    cost.observe_copy(10**9, 1.0)
    assert cost.swap_is_cheaper(10**12, 1)  # no prefill rate yet


def test_the_cheaper_way_wins():
    """1 GB/s and 1 ms a prefill token: 1 MB swaps in 2 ms, against 1 ms for one token and 3 ms for three."""
    cost = PreemptionCost()
    cost.observe_copy(10**6, 1e-3)
    cost.observe_step(seconds=0.1, num_tokens=100, num_requests=2)
    assert cost.link_bytes_per_s == pytest.approx(1e9) and cost.prefill_s_per_token == pytest.approx(1e-3)
    assert not cost.swap_is_cheaper(10**6, 1)
    assert cost.swap_is_cheaper(10**6, 3)


def test_decode_steps_leave_the_prefill_rate_alone():
    cost = PreemptionCost()
    cost.observe_step(seconds=0.01, num_tokens=64, num_requests=64)
    assert cost.prefill_s_per_token is None
    cost.observe_step(seconds=0.05, num_tokens=200, num_requests=10)
    cost.observe_step(seconds=0.1, num_tokens=200, num_requests=10)  # 0.8 x 0.25 ms + 0.2 x 0.5 ms
    assert cost.prefill_s_per_token == pytest.approx(0.3e-3)
