"""`Metrics`: Prometheus series named like vLLM's (`vllm:` -> `rimuru:`) plus the page pool, in a registry per app.

Updated by the engine thread only (prometheus_client is thread-safe; `/metrics` reads from the event loop).
Expert traffic comes from `engine.expert_stats` when the engine has it (a dict, or a method returning one) and
reads as zeros otherwise, so the names exist whatever the memory policy.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0)  # fmt: skip
EXPERT_COUNTERS = ("evictions", "additions", "swaps", "bytes_copied", "prefetch_hits", "prefetch_misses",
                   "direct_reads")  # direct_reads: host experts the kernels read in place (expert_reads="direct")
# the cost adjuster's live model (`cost_*` in `Engine.expert_stats`): why the pool moved
ADJUSTER_ESTIMATES = ("predicted_copy_ms", "measured_copy_ms", "compute_ms", "bandwidth_gb_s", "touch_p_mean",
                      "touch_p_max", "affordable_evictions", "oldest_wait_s", "slo_missed", "calibration",
                      "requests_per_expert")  # fmt: skip
POOL_KINDS = ("expert", "kv", "state", "free", "trapped")  # state: a hybrid model's SSM and conv pages


def read_expert_stats(engine) -> dict:
    stats = getattr(engine, "expert_stats", None)
    if callable(stats):
        stats = stats()
    return stats if isinstance(stats, dict) else {}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels, label_values = ["model_name"], [model_name]

        def gauge(name, doc, extra=()):
            return Gauge(f"rimuru:{name}", doc, labels + list(extra), registry=registry)

        def counter(name, doc):
            return Counter(f"rimuru:{name}", doc, labels, registry=registry).labels(*label_values)

        def histogram(name, doc, buckets):
            return Histogram(f"rimuru:{name}", doc, labels, buckets=buckets, registry=registry).labels(*label_values)

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.").labels(model_name)
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting.").labels(model_name)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV pages used / obtainable.").labels(model_name)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Time between two tokens.",
                                               _LATENCY_BUCKETS)  # fmt: skip
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.request_success = Counter("rimuru:request_success", "Finished sequences by reason.",
                                       labels + ["finished_reason"], registry=registry)  # fmt: skip
        self._pool_pages = gauge("pool_pages", "Pool pages by kind (free counted in expert pages).", ["kind"])
        self._pool_bytes = gauge("pool_bytes", "Pool bytes by kind.", ["kind"])
        self._expert = {name: counter(f"expert_{name}", f"Expert {name.replace('_', ' ')} (expert offloading).")
                        for name in EXPERT_COUNTERS}  # fmt: skip
        self._expert_seen = dict.fromkeys(EXPERT_COUNTERS, 0)
        self.offloaded_experts = gauge("offloaded_experts", "Routed experts on the host now.").labels(model_name)
        estimates = gauge("adjuster_estimate", "The cost adjuster's model: copy and compute ms a step, bandwidth GB/s, "
                          "touch probability, profitable evictions, oldest wait s, calibration (measured / predicted "
                          "link time), requests an evicted expert admits (0 under the paper's rule).",
                          ["estimate"])  # fmt: skip
        self._estimates = {name: estimates.labels(model_name, name) for name in ADJUSTER_ESTIMATES}
        self._preemptions_seen = 0
        self.model_name = model_name
        for name in POOL_KINDS:
            self._pool_pages.labels(model_name, name).set(0)
            self._pool_bytes.labels(model_name, name).set(0)

    def update_engine(self, engine, split: dict, kv_usage: float, stats: dict | None = None) -> None:
        """Gauges and cumulative counters from the engine's state after a step (`stats`: its expert stats, read
        here when not given). Engine thread."""
        scheduler = engine.scheduler
        self.num_requests_running.set(len(scheduler.running))
        self.num_requests_waiting.set(len(scheduler.waiting))
        self.kv_cache_usage_perc.set(kv_usage)
        for kind in POOL_KINDS:
            self._pool_pages.labels(self.model_name, kind).set(split[f"{kind}_pages"])
            self._pool_bytes.labels(self.model_name, kind).set(split[f"{kind}_bytes"])
        self._preemptions_seen = _advance(self.num_preemptions, scheduler.num_preemptions, self._preemptions_seen)
        stats = read_expert_stats(engine) if stats is None else stats
        for name in EXPERT_COUNTERS:
            self._expert_seen[name] = _advance(self._expert[name], stats.get(name, 0), self._expert_seen[name])
        self.offloaded_experts.set(stats.get("offloaded_experts", 0))
        for name, gauge in self._estimates.items():
            gauge.set(stats.get(f"cost_{name}", 0))

    def finished(self, reason: str | None) -> None:
        self.request_success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _advance(counter, total: float, seen: float) -> int | float:
    """Counters only go up: add what a cumulative total grew by since last time."""
    if total > seen:
        counter.inc(total - seen)
    return max(total, seen)
