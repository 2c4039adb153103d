"""The cost of offloading experts, from live measurements: what one more offloaded expert adds to a step's copies.

Pure functions first (tested on hand-computed numbers), then `CostModel`, which only keeps the measurements:
- host -> device bandwidth, from the copies the engine makes anyway (start-up placement, misses, prefetches,
  additions), timed by the copier (CUDA events on a GPU, wall time on CPU);
- compute time per step: the engine's wall time around the forward pass and sampling;
- tokens per step, requests running and KV pages a running request holds (what evicting one more expert admits).
Timings (bandwidth, compute) are exponential moving averages, the batch's figures the last step's; `pin` fixes any
of them (tests, or an operator who knows better).

The model, kept simple on purpose:
- a batch of T tokens routes T x K times; an expert of routing share p is touched by it with probability
  1 - (1 - p)^(T K) (routings treated as independent draws);
- an offloaded expert touched in a step costs one copy of its bytes; a step's predicted copy time is the sum over
  offloaded experts of P(touched) x bytes / bandwidth;
- what prefetch hides is the compute time itself: prefetches run on a side stream under the previous layer's
  kernels, but the link carries one copy at a time, so the copies stay hidden only while their total fits in the
  step's compute. Misses (copies on the compute stream) are not hidden at all; the rule's ratio (default 1.0)
  leaves no slack for them, which is why the ratio is a knob. Direct reads hide nothing: the expert kernel waits
  for them inside its layer;
- the link time a step is exposed to adds to the step: `exposed_seconds`.
"""

from dataclasses import dataclass

import torch


def touch_probability(share, num_tokens: float, top_k: int):
    """P(an expert of routing share p is picked at least once by `num_tokens` tokens x `top_k`). `share`: a float,
    or a tensor of shares (elementwise: the hundreds of offloaded experts a refresh weighs, in a few kernels)."""
    p = share.clamp(0.0, 1.0) if isinstance(share, torch.Tensor) else min(max(share, 0.0), 1.0)
    return 1.0 - (1.0 - p) ** (num_tokens * top_k)


def copy_seconds(shares, num_tokens: float, top_k: int, expert_bytes: int, bandwidth: float) -> float:
    """Predicted copy time a step spends on offloaded experts of these routing shares (a list or a tensor)."""
    touched = touch_probability(torch.as_tensor(shares, dtype=torch.float64), num_tokens, top_k)
    return float(touched.sum()) * expert_bytes / bandwidth


def exposed_seconds(link_s: float, hidden_s: float) -> float:
    """The part of a step's predicted link time (copies or direct reads) that its compute does not hide."""
    return max(0.0, link_s - hidden_s)


def kv_pages_freed(num_experts: int, pages_per_expert: int, kv_pages_per_expert_page: int) -> int:
    """KV pages that evicting `num_experts` experts frees (3 expert pages each, each split into KV pages)."""
    return num_experts * pages_per_expert * kv_pages_per_expert_page


def ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostModel:
    """Live measurements (moving averages); None until the first one arrives."""

    bandwidth: float | None = None  # bytes/s host -> device
    compute_s: float | None = None  # seconds a step computes
    tokens_per_step: float | None = None
    running: float | None = None  # requests running a step
    kv_pages_per_request: float | None = None  # KV pages a running request holds
    weight: float = 0.1  # of each new measurement in the average
    pinned: frozenset = frozenset()  # names `observe_*` leaves alone

    def pin(self, **values: float) -> None:
        """Fix measurements (e.g. `pin(bandwidth=1e9)`): later observations no longer move them."""
        for name, value in values.items():
            setattr(self, name, value)
        self.pinned = self.pinned | set(values)

    def observe_copies(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0 and "bandwidth" not in self.pinned:
            self.bandwidth = ema(self.bandwidth, num_bytes / seconds, self.weight)

    def observe_step(self, seconds: float, num_tokens: int, running: int = 0, kv_pages: int = 0) -> None:
        """One step: its wall time and tokens, the requests running and the KV pages they hold. The batch's own
        figures (tokens, running, pages a request) are taken as they are now, not averaged: they describe the batch
        an eviction would act on, and averages still holding a warm-up's 6 requests when 65 ran made the first
        evictions look 10x cheaper than they were. A step mostly of prefill tokens (over twice its requests) is left
        out: the model weighs decode throughput."""
        if running and num_tokens > 2 * running:
            return
        if "compute_s" not in self.pinned:
            self.compute_s = ema(self.compute_s, seconds, self.weight)
        current = {"tokens_per_step": float(num_tokens), "running": float(running)}
        if running > 0:
            current["kv_pages_per_request"] = kv_pages / running
        for name, value in current.items():
            if name not in self.pinned:
                setattr(self, name, value)

    @property
    def is_measured(self) -> bool:
        return None not in (self.bandwidth, self.compute_s, self.tokens_per_step)
