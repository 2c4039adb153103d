"""Where one engine step's time goes: torch.profiler over decode steps of a running batch.

Runs `--num-requests` requests of a JSONL stream into decode, then profiles `--steps` steps and prints the ops with
the most self CPU time and the most CUDA time, and the host time of each part of the step (schedule, prepare,
forward, sample). Writes a Chrome trace when `--trace` is given.

    python tools/profile_step.py MODEL_DIR --stream stream.jsonl --load-format dummy --num-requests 200
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rimuru.benchmark import read_stream
from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.sampling_params import SamplingParams
from rimuru.serving.cli import add_engine_arguments, engine_options


def fill(engine: Engine, requests: list[dict]) -> None:
    """Submit the requests and step until every prompt is prefilled, so the profiled steps are decodes."""
    for r in requests:
        engine.add_request(r["id"], r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    while any(q.num_computed_tokens < len(q.prompt_token_ids) for q in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def timed_steps(engine: Engine, steps: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return (time.perf_counter() - start) / steps


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    add_engine_arguments(parser)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, **engine_options(args)))
    fill(engine, read_stream(args.stream, args.num_requests))
    timed_steps(engine, 3)  # warm-up
    print(f"decode step, {len(engine.scheduler.running)} running: {timed_steps(engine, args.steps) * 1e3:.2f} ms")
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
