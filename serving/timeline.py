"""`Timeline`: the pool split, the queue and the adjuster's state over time, recorded by the engine thread, read by
`/v1/memory`.

A bounded ring buffer of samples taken at most every `interval_s` (a busy engine steps every millisecond or so;
the dashboard needs a few points a second). Tokens are summed between samples into a tokens/s rate. The lock
makes `snapshot()` safe from the event-loop thread while the engine thread appends.
"""

import threading
import time
from collections import deque

# why the pool moved: the experts on the host, and the cost adjuster's model (zeros under the paper's rule)
ADJUSTER_FIELDS = {"offloaded_experts": "offloaded_experts", "predicted_copy_ms": "cost_predicted_copy_ms",
                   "measured_copy_ms": "cost_measured_copy_ms", "compute_ms": "cost_compute_ms",
                   "touch_p_mean": "cost_touch_p_mean", "affordable_evictions": "cost_affordable_evictions",
                   "calibration": "cost_calibration"}  # fmt: skip
FIELDS = ("t", "expert_pages", "kv_pages", "state_pages", "trapped_pages", "free_pages", "expert_bytes", "kv_bytes",
          "state_bytes", "trapped_bytes", "free_bytes", "running", "waiting", "tokens_per_s",
          *ADJUSTER_FIELDS)  # fmt: skip


def pool_split(stats: dict) -> dict:
    """Pages and bytes by kind from `PageAllocator.stats()`; free pages are counted in expert pages, and a hybrid
    model's SSM and conv pages together as its linear-attention state."""
    return {
        "expert_pages": stats.get("expert_used_pages", 0),
        "kv_pages": stats.get("kv_used_pages", 0),
        "state_pages": stats.get("ssm_used_pages", 0) + stats.get("conv_used_pages", 0),
        "trapped_pages": stats.get("kv_trapped_pages", 0),
        "free_pages": stats.get("free_expert_pages", 0),
        "expert_bytes": stats.get("expert_used_bytes", 0),
        "kv_bytes": stats.get("kv_used_bytes", 0),
        "state_bytes": stats.get("ssm_used_bytes", 0) + stats.get("conv_used_bytes", 0),
        "trapped_bytes": stats.get("trapped_bytes", 0),
        "free_bytes": stats.get("free_bytes", 0),
    }


def adjuster_state(expert_stats: dict) -> dict:
    """The `ADJUSTER_FIELDS` of `Engine.expert_stats`, 0 where the engine has none."""
    return {name: round(float(expert_stats.get(key, 0)), 4) for name, key in ADJUSTER_FIELDS.items()}


class Timeline:
    def __init__(self, max_samples: int = 600, interval_s: float = 0.1):
        self.interval_s = interval_s
        self._samples: deque[tuple] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_t = None
        self._tokens = 0
        self.current: dict = {}

    def add_tokens(self, count: int) -> None:
        self._tokens += count

    def is_due(self) -> bool:
        """Whether the last sample is at least `interval_s` old."""
        return self._last_t is None or time.monotonic() - self._last_t >= self.interval_s

    def record(self, split: dict, running: int, waiting: int) -> None:
        """Append a sample (the caller asks `is_due()` first). Engine thread only."""
        now = time.monotonic()
        rate = self._tokens / (now - self._last_t) if self._last_t is not None and now > self._last_t else 0.0
        self._last_t, self._tokens = now, 0
        sample = {"t": round(now - self._start, 3), **split, "running": running, "waiting": waiting,
                  "tokens_per_s": round(rate, 2)}  # fmt: skip
        with self._lock:
            self._samples.append(tuple(sample[f] for f in FIELDS))
            self.current = sample

    def snapshot(self) -> dict:
        """{"current": the newest sample, "series": {field: [values, oldest first]}}. Any thread."""
        with self._lock:
            samples, current = list(self._samples), dict(self.current)
        series = {f: [s[i] for s in samples] for i, f in enumerate(FIELDS)}
        return {"current": current, "series": series, "interval_s": self.interval_s}
