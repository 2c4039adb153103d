"""Time the sampler on a step of sampled (non-greedy, unseeded) requests, and count the torch operations it runs
(on a GPU each is a kernel launch from the host).

    python -m tools.engine.sampler [--rows 140] [--vocab 151936] [--device cuda] [--against OLD_SAMPLER_PY]

Each row asks temperature 0.8, top-p 0.95 and every fourth top-k 50 (what API clients send). `--against` runs an
older rimuru/sampler.py's `Sampler` on the same logits, alternated with this one. Prints JSON: median ms a step and
the aten operations a step of each.
"""

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from rimuru.sampler import Sampler
from rimuru.sampling_params import SamplingParams
from tools.records import load_version


def operations(step) -> int:
    """aten operations one call runs (CPU profiler events named aten::...)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=140)
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen1.5-MoE and Qwen3's
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--against", default=None, metavar="SAMPLER_PY")
    args = parser.parse_args()
    device = torch.device(args.device)
    logits = torch.randn(args.rows, args.vocab, device=device, generator=torch.Generator(device).manual_seed(0))
    requests = [SimpleNamespace(params=SamplingParams(temperature=0.8, top_p=0.95, top_k=50 if i % 4 == 0 else 0),
                                generator=None) for i in range(args.rows)]  # fmt: skip
    samplers = {"this": Sampler(torch.Generator(device).manual_seed(0))}
    if args.against:
        older = load_version(args.against, "sampler_against").Sampler
        samplers["against"] = older(torch.Generator(device).manual_seed(0))
    steps = {name: (lambda s=sampler: s(logits, requests)) for name, sampler in samplers.items()}
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(timed(step, device))
    result = {name: {"ms_median": round(statistics.median(t) * 1e3, 3), "aten_ops": operations(steps[name])}
              for name, t in times.items()}  # fmt: skip
    print(json.dumps(result | {"rows": args.rows, "vocab": args.vocab, "device": args.device}))


if __name__ == "__main__":
    main()
