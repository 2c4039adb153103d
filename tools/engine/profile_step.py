"""Where one engine step's time goes: torch.profiler over decode steps of a running batch.

Runs `--num-requests` requests of a JSONL stream into decode, then profiles `--steps` steps and prints the ops with
the most self CPU time and the most CUDA time, and the host time of each part of the step (schedule, prepare,
forward, sample). Writes a Chrome trace when `--trace` is given.

    python -m tools.engine.profile_step MODEL_DIR --stream stream.jsonl --load-format dummy --num-requests 200
    python -m tools.engine.profile_step MODEL_DIR --stream stream.jsonl --load-format dummy --num-requests 64 \
        --gpu-memory-budget 30GiB --expert-policy fixed --offload-per-layer 8     # the hook's share of a step

`--stub-attention` replaces every layer's attention with a copy of its query before the graphs are captured: the
step's time without attention, whatever a profiler says a kernel takes inside it (the tokens are then not the model's).
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import rimuru.ops as ops
from rimuru.benchmark import read_stream
from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.pending_tokens import PendingTokens
from rimuru.sampler import Sampler
from rimuru.sampling_params import SamplingParams
from rimuru.serving.cli import add_engine_arguments, engine_options


def fill(engine: Engine, requests: list[dict], max_tokens: int = 4096) -> None:
    """Submit the requests and step until every prompt is prefilled, so the profiled steps are decodes. The growth
    forecast admits as many as can reach `max_tokens`: a smaller allowance profiles a larger batch."""
    for r in requests:
        room = min(max_tokens, engine.config.max_model_len - len(r["prompt_token_ids"]))
        engine.add_request(r["id"], r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))
    while any(q.num_computed_tokens < len(q.prompt_token_ids) for q in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def add_fill_arguments(parser: argparse.ArgumentParser, num_requests: int, max_tokens: int) -> None:
    """The model, the stream and the batch `fill` runs into decode, with these defaults."""
    parser.add_argument("model")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="each request's allowance (sizes the batch)")


def cycled(tokens: list[int], length: int) -> list[int]:
    """`tokens` repeated to `length` tokens: a decode step at a drain's long contexts from any stream's prompts."""
    return (tokens * -(-length // len(tokens)))[:length]


def timed_steps(engine: Engine, steps: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return (time.perf_counter() - start) / steps


def host_phases(engine: Engine, steps: int) -> dict[str, float]:
    """Host milliseconds a step in each phase (no synchronisation added: `sample` includes the wait for the GPU)."""
    totals: dict[str, float] = {}
    manager = engine.expert_manager
    phases = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
              (Sampler, "__call__", "sample, waiting for the GPU (no async scheduling)"),
              (PendingTokens, "wait", "wait for the last step's tokens (async scheduling)"),
              (engine, "_append", "append and stop checks"),
              (manager, "begin_step", "expert changes"), (manager, "end_step", "expert changes"),
              (engine, "_adjust", "adjuster round"), (engine.adjuster, "observe", "cost rule: observe")]  # fmt: skip
    phases = [(obj, name, label) for obj, name, label in phases if hasattr(obj, name)]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in phases]
    for (obj, name, label), (_, _, fn) in zip(phases, originals):
        setattr(obj, name, _timed(fn, label, totals))
    before = manager.stats.as_dict()
    try:
        step = timed_steps(engine, steps)
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
    hook = {label: (getattr(manager.stats, key) - before[key]) * 1e3 for key, label in HOOK_TIMES.items()}
    return {label: ms / steps for label, ms in (totals | hook).items()} | {"whole step": step * 1e3}


HOOK_TIMES = {  # the routing hook's host time (inside forward), from the expert manager's counters
    "hook_seconds": "routing hook (inside forward)",
    "routing_wait_seconds": "  of it, waiting for the router",
    "prefetch_seconds": "  of it, issuing prefetches (graphs: after the next piece is queued)",
}


def _timed(fn, label: str, totals: dict[str, float]):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + (time.perf_counter() - start) * 1e3

    return call


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_fill_arguments(parser, num_requests=200, max_tokens=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--context", type=int, default=None, help="every prompt cycled to this many tokens")
    parser.add_argument("--stub-attention", action="store_true",
                        help="timing only: each layer's attention a copy of its query (what attention costs a step)")
    add_engine_arguments(parser)
    args = parser.parse_args()
    if args.stub_attention:  # before the engine captures its graphs; the tokens change, the other kernels' work not
        ops.paged_attention = lambda query, *_: query.clone()
    engine = Engine(EngineConfig(model=args.model, **engine_options(args)))
    requests = read_stream(args.stream, args.num_requests)
    if args.context:
        requests = [r | {"prompt_token_ids": cycled(r["prompt_token_ids"], args.context)} for r in requests]
    fill(engine, requests, args.max_tokens)
    timed_steps(engine, 3)  # warm-up
    print(f"decode step, {len(engine.scheduler.running)} running: {timed_steps(engine, args.steps) * 1e3:.2f} ms")
    for label, ms in host_phases(engine, args.steps).items():
        print(f"  {label}: {ms:.3f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        timed_steps(engine, args.steps)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
