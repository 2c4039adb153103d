"""`PreemptionCost`: which way a preempted request comes back cheaper, its pages copied to the host and back or its
tokens recomputed, from the engine's own measurements.

- A swap moves the request's pages across the host link twice: `2 x bytes / link rate`, the rate timed on the swaps
  themselves (each save waits for its copy).
- A recompute prefills every token the request had computed: `tokens x seconds a prefill token takes`, timed on the
  engine's steps that are mostly prefill (over twice as many tokens as requests).

Until both are measured a victim is swapped: a token's KV is a few hundred KiB at most, and on the GPUs Rimuru
targets its two copies take less than its prefill. A hybrid's state pages are a fixed few MiB a linear layer, so a
short request of a hybrid model is the case the rule recomputes.
"""

from dataclasses import dataclass

from rimuru.cost_model import ema


def swap_seconds(num_bytes: int, link_bytes_per_s: float) -> float:
    """Out to the host and back in."""
    return 2 * num_bytes / link_bytes_per_s


def recompute_seconds(num_tokens: int, prefill_s_per_token: float) -> float:
    return num_tokens * prefill_s_per_token


@dataclass
class PreemptionCost:
    """Moving averages of the two rates; None until the first measurement."""

    link_bytes_per_s: float | None = None
    prefill_s_per_token: float | None = None
    weight: float = 0.2  # of each new measurement in the average

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.link_bytes_per_s = ema(self.link_bytes_per_s, num_bytes / seconds, self.weight)

    def observe_step(self, seconds: float, num_tokens: int, num_requests: int) -> None:
        """A step mostly of prefill gives the rate a recompute runs at; decode steps say nothing about it."""
        if seconds > 0 and num_tokens > 2 * num_requests:
            self.prefill_s_per_token = ema(self.prefill_s_per_token, seconds / num_tokens, self.weight)

    def swap_is_cheaper(self, num_bytes: int, num_tokens: int) -> bool:
        if self.link_bytes_per_s is None or self.prefill_s_per_token is None:
            return True
        return swap_seconds(num_bytes, self.link_bytes_per_s) < recompute_seconds(num_tokens, self.prefill_s_per_token)
