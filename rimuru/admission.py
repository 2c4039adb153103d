"""`GrowthForecast`: whether the pool can carry the running batch, and one more request, to their ends.

A request admitted because its prompt fits today can still run the pool dry as the batch decodes, and then some
request is preempted and recomputes its prompt. So the scheduler admits a request only when the batch's predicted
demand never exceeds the KV pages it can have:

    request i holds c_i tokens and will write r_i more (its predicted remaining output), one a step;
    at step t it needs ceil((c_i + t) / page_tokens) pages a layer while t <= r_i, none after;
    demand(t) = sum of those; it grows between two ends and drops at each, so its peak is at some t = r_j.

The remaining output is `ratio * (max_tokens - generated)`: `ratio` is the mean share of their allowance that
recently finished requests used (exactly 1 when outputs run to max_tokens, as a benchmark's do; lower where EOS
comes first), starting at 1. A request that outgrows the forecast is still served: the scheduler preempts as before.
Pure arithmetic over numbers the scheduler hands in; owns only the ratio.
"""

import math

import numpy as np

from rimuru.request import Request

RATIO_WEIGHT = 1 / 32  # a finished request's weight in the running mean of the share of max_tokens used
DIRECT_MAX_REQUESTS = 16  # up to this many, the definition in plain Python beats numpy's call overhead


class GrowthForecast:
    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.ratio = 1.0

    def observe_finished(self, request: Request) -> None:
        """A request that ended on its own (stop or length, not abort): the share of its allowance it used."""
        if request.max_tokens > 0:
            used = min(1.0, len(request.output_token_ids) / request.max_tokens)
            self.ratio += RATIO_WEIGHT * (used - self.ratio)

    def remaining(self, request: Request) -> int:
        """Output tokens the request is predicted to still write (at least 1 while any are allowed)."""
        left = request.max_tokens - len(request.output_token_ids)
        return max(min(left, 1), math.ceil(self.ratio * left))

    def peak_pages(self, requests: list[Request]) -> int:
        """The most KV pages a layer the requests will hold at once, if none is preempted and none joins."""
        if not requests:
            return 0
        tokens = [r.num_tokens for r in requests]  # c [n]
        growth = [self.remaining(r) for r in requests]  # r [n]
        if len(requests) <= DIRECT_MAX_REQUESTS:  # a drain's few requests: the step's whole adjuster round otherwise
            return peak_demand_direct(tokens, growth, self.page_tokens)
        return peak_demand(np.array(tokens, dtype=np.int64), np.array(growth, dtype=np.int64), self.page_tokens)


def peak_demand_direct(tokens: list[int], growth: list[int], page: int) -> int:
    """`peak_demand` by its definition, each end's sum in turn: O(n^2)."""
    return max(sum((c + end + page - 1) // page for c, r in zip(tokens, growth) if r >= end) for end in set(growth))


def peak_demand(tokens: np.ndarray, growth: np.ndarray, page: int) -> int:
    """max over j of sum over {i: r_i >= r_j} of ceil((c_i + r_j) / page), in O(n * page) (module docstring).

    With s_i = c_i + page - 1 and t = r_j: floor((s_i + t) / page) = s_i // page + t // page + [s_i % page +
    t % page >= page], so each end's sum is a prefix sum (requests by r descending) plus a count of residues."""
    order = np.argsort(-growth, kind="stable")
    shifted, ends = tokens[order] + page - 1, growth[order]  # [n], by end, latest first
    quotient_sums = np.cumsum(shifted // page)  # [n] over the requests running at each end
    running = np.arange(1, len(ends) + 1)
    residues = np.zeros((len(ends), page + 1), dtype=np.int64)  # [n, page + 1] one-hot residues, a zero column
    residues[running - 1, shifted % page] = 1
    at_least = np.cumsum(residues[:, ::-1], axis=1)[:, ::-1]  # [n, page + 1] residues >= column, this request
    carries = np.cumsum(at_least, axis=0)[running - 1, page - ends % page]  # [n] prefix count of a carry
    return int((quotient_sums + running * (ends // page) + carries).max())
