"""`run_benchmark`: replay a request stream against the engine in real time and record what a user would see.

Each request is submitted at its arrival time (seconds from the start; 0 for all = a throughput run), greedy with
EOS ignored so its output length is the stream's `max_tokens`. The record holds throughput, TTFT / TPOT / ITL
statistics, concurrency, the engine's expert traffic, the peak reserved GPU memory (proof that the budget held)
and a per-step time series of the pool split, the queues and where the step's wall time went
(`Engine.step_phases`). The stream format is one JSON object a line: {"id", "arrival", "prompt_token_ids",
"max_tokens"}.

Owns the replay and the record behind `rimuru bench`, nothing else: sweeps, tables, plots and the GPU jobs are
benchmark tooling in tools/ (outside the package), and the commit a record names comes from the environment.
"""

import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from rimuru.engine import Engine
from rimuru.sampling_params import SamplingParams


def source_commit() -> str | None:
    """The commit a record was made at: $RIMURU_COMMIT (the device session sets it; a tool running from a checkout
    may set it too), else None. The engine never asks git: an installed package has no checkout to ask."""
    return os.environ.get("RIMURU_COMMIT") or None


STREAM_FIELDS = {"id": str, "arrival": (int, float), "prompt_token_ids": list, "max_tokens": int}


def read_stream(path: str, limit: int | None = None) -> list[dict]:
    """The stream's requests by arrival (the first `limit` lines); ValueError naming the file and line of the first
    request that is not JSON or lacks a field of the format, before any is run."""
    with open(path) as f:
        requests = [_stream_request(line, path, number) for number, line in enumerate(f, 1) if line.strip()]
    return sorted(requests[:limit] if limit else requests, key=lambda r: r["arrival"])


def _stream_request(line: str, path: str, number: int) -> dict:
    try:
        request = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} line {number}: not JSON ({error.msg})") from None
    for field, kind in STREAM_FIELDS.items():
        if not isinstance(request, dict) or not isinstance(request.get(field), kind):
            raise ValueError(f"{path} line {number}: a request needs {field!r} ({', '.join(STREAM_FIELDS)})")
    return request


class _Clock:
    """Per-request times: arrival, each token."""

    def __init__(self):
        self.arrival: dict[str, float] = {}
        self.tokens: dict[str, list[float]] = {}


def run_benchmark(engine: Engine, requests: list[dict], progress: bool = True,
                  time_limit_s: float | None = None) -> dict:  # fmt: skip
    """Replay `requests`; returns the record (see the module docstring). Mutates the engine's queues only. With
    `time_limit_s` the replay stops there, aborts what is unfinished and says so (`truncated_at_s`): a record of the
    part that ran rather than none, for runs that might outlast their slot."""
    clock, series = _Clock(), []
    pending, start = list(requests), time.perf_counter()
    before = _counters(engine)
    lagged_direct_reads = engine.expert_manager.counter.lagged_direct_reads()  # the series' own reader
    limit, finished = float("inf") if time_limit_s is None else time_limit_s, 0
    with tqdm(total=len(requests), desc="Benchmark", unit="req", disable=not progress) as bar:
        while (pending or engine.has_unfinished()) and (now := time.perf_counter() - start) < limit:
            while pending and pending[0]["arrival"] <= now:
                _submit(engine, pending.pop(0), clock, now)
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(pending[0]["arrival"], limit) - now))
                continue
            updated = engine.step()
            now = time.perf_counter() - start
            for request in updated:
                clock.tokens.setdefault(request.request_id, []).append(now)
            done = sum(r.is_finished for r in updated)
            finished += done
            bar.update(done)
            series.append(_sample(engine, now, sum(1 for _ in updated), before, lagged_direct_reads))
    wall = time.perf_counter() - start
    truncated = bool(pending or engine.has_unfinished())
    if truncated:
        for request_id in clock.arrival:
            engine.abort(request_id)
    record = _record(engine, requests, clock, series, wall, before)
    return record | {"finished_requests": finished, "truncated_at_s": round(wall, 3) if truncated else None}


def _submit(engine: Engine, request: dict, clock: _Clock, now: float) -> None:
    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
    engine.add_request(request["id"], request["prompt_token_ids"], params)
    clock.arrival[request["id"]] = now


# the cost rule's inputs and decision each step: what `tools/reports/plot.py` draws as the rule's view
SERIES_ESTIMATES = ("cost_affordable_evictions", "cost_calibration", "cost_predicted_copy_ms", "cost_measured_copy_ms",
                    "cost_next_eviction_ms", "cost_compute_ms", "cost_tokens_per_step", "cost_running",
                    "cost_requests_per_expert", "cost_profitable_this_refresh")  # fmt: skip


def _sample(engine: Engine, now: float, num_tokens: int, before: dict, lagged_direct_reads: Callable[[], int]) -> dict:
    stats = engine.allocator.stats()
    estimates = {} if engine.adjuster is None else engine.adjuster.estimates  # the cost rule's view, each step
    manager = engine.expert_manager
    # direct reads, cumulative: one 8-byte read from the GPU a step; with a pass queued (async scheduling), the
    # read of the step before, which does not wait for it
    read = manager.direct_reads if engine.in_flight is None else lagged_direct_reads
    reads = {"direct_reads": read() - before["experts"]["direct_reads"]} if manager.direct else {}
    return {k: round(estimates[k], 4) for k in SERIES_ESTIMATES if k in estimates} | reads | {
        "t": round(now, 4),
        **{f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in engine.step_phases.items()},
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "tokens": num_tokens,
        "expert_pages": stats["expert_used_pages"],
        "kv_pages": stats["kv_used_pages"],
        "free_expert_pages": stats["free_expert_pages"],
        "trapped_kv_pages": stats["kv_trapped_pages"],
        "offloaded_experts": engine.experts.num_offloaded,
        "prefetch_hits": engine.expert_manager.stats.prefetch_hits - before["experts"]["prefetch_hits"],  # cumulative
        "prefetch_misses": engine.expert_manager.stats.prefetch_misses - before["experts"]["prefetch_misses"],
    }


def _counters(engine: Engine) -> dict:
    """The engine's running totals, so a record counts only its own run (not a warm-up before it)."""
    return {"forward_steps": engine.num_steps, "graph_steps": engine.runner.num_graph_steps,
            "adjuster_seconds": engine.adjuster_seconds,
            "preemptions": engine.scheduler.num_preemptions, "refusals": engine.scheduler.num_refusals,
            "swapped": 0 if engine.scheduler.swap is None else engine.scheduler.swap.num_saved,
            "experts": engine.expert_manager.stats_dict()}  # fmt: skip  # counters only, not the pool's gauges


def _record(engine: Engine, requests, clock: _Clock, series, wall, before: dict) -> dict:
    ttft = [clock.tokens[r][0] - clock.arrival[r] for r in clock.arrival if r in clock.tokens]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in clock.tokens.values() if len(t) > 1]
    itl = [b - a for t in clock.tokens.values() for a, b in zip(t, t[1:])]
    output_tokens = sum(len(t) for t in clock.tokens.values())
    experts = {key: value - before["experts"][key] for key, value in engine.expert_manager.stats_dict().items()}
    lookups = experts["prefetch_hits"] + experts["prefetch_misses"]
    return {
        "requests": len(requests),
        "output_tokens": output_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "requests_per_s": round(len(requests) / wall, 3),
        "ttft_s": _summary(ttft),
        "tpot_s": _summary(tpot),
        "itl_s": _summary(itl),
        "peak_concurrency": max((s["running"] for s in series), default=0),
        "mean_concurrency": round(statistics.fmean(s["running"] for s in series), 2) if series else 0,
        "forward_steps": engine.num_steps - before["forward_steps"],
        "graph_steps": engine.runner.num_graph_steps - before["graph_steps"],  # of those, CUDA graph replays
        "preemptions": engine.scheduler.num_preemptions - before["preemptions"],
        "preemptions_swapped": _counters(engine)["swapped"] - before["swapped"],  # recovered by a copy, not a prefill
        "admission_refusals": engine.scheduler.num_refusals - before["refusals"],  # rounds the forecast said wait
        "evictions": experts["evictions"],
        "additions": experts["additions"],
        "swaps": experts["swaps"],
        "direct_reads": experts["direct_reads"],  # expert_reads="direct": host experts read in place, per layer pass
        "bytes_copied": experts["bytes_copied"],
        "prefetch_hit_rate": round(experts["prefetch_hits"] / lookups, 4) if lookups else None,
        "hook_seconds": round(experts["hook_seconds"], 3),
        "routing_wait_seconds": round(experts["routing_wait_seconds"], 3),  # of it, the GPU finishing layers
        "prefetch_seconds": round(experts["prefetch_seconds"], 3),  # of it, issuing prefetches (graphs: overlapped)
        "adjuster_seconds": round(engine.adjuster_seconds - before["adjuster_seconds"], 3),  # host, between passes
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
        # what tensors held at the peak: reserved far above it is the caching allocator's fragmentation
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "series": series,
    }


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(ordered), 5),
        "median": round(statistics.median(ordered), 5),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 5),
    }
