"""Time one decode-heavy scheduling round of the `Scheduler` on this host, with the page tables' device copy.

The round: `--running` requests (default 140, the paper scenario's peak) each decode a token; one crossing a 16-token
page boundary takes a KV page in each of the 24 attention layers (Qwen1.5-MoE-A2.7B sizes); a request finishing
frees its pages and a new one (16-400 prompt tokens, 100-400 output) takes its place. Each round is
`Scheduler.schedule()` then `KVCacheManager.sync_device()`, what `Engine.step` and the runner do before a pass,
with the page tables' device copy on `--device` (default: the GPU when there is one, as the engine keeps it under
CUDA graphs; on the CPU it is a test-only path, each copy a memcpy; `none`: no copy). Prints JSON: median, mean and p99 microseconds
a round.

    python tools/bench_scheduler.py [--running 140] [--rounds 3000] [--seed 0] [--device cuda|cpu|none]
    git show 026cd3f:rimuru/kv_cache.py > /tmp/kv_old.py
    python tools/bench_scheduler.py --device none --against /tmp/kv_old.py   # rounds of both, alternated
"""

import argparse
import importlib.util
import json
import platform
import random
import statistics
import time

import torch

from rimuru.kv_cache import KVCacheManager
from rimuru.memory import PageAllocator, page_sizes
from rimuru.request import Request
from rimuru.sampling_params import SamplingParams
from rimuru.scheduler import Scheduler, SchedulerConfig

LAYERS, PAGE_TOKENS, MAX_SEQS = 24, 16, 256
SIZES = page_sizes((1408 * 2048,), (2, PAGE_TOKENS, 16, 128), torch.bfloat16)  # Qwen1.5-MoE-A2.7B


class Emulator:
    def __init__(self, running: int, seed: int, device: torch.device | None, kv_cache_class=KVCacheManager):
        self.rng = random.Random(seed)
        allocator = PageAllocator(SIZES, 3000 * SIZES.expert_page_bytes)
        for owner in [(layer, e) for layer in range(LAYERS) for e in range(16)]:  # 1,152 expert pages resident
            allocator.allocate_expert(owner)
        self.kv_cache = kv_cache_class(allocator, LAYERS, PAGE_TOKENS, MAX_SEQS, 4096, device_copy=device)  # None: none
        if not hasattr(self.kv_cache, "holds"):  # a manager from before 761eb21: every round asks `allocate`
            self.kv_cache.holds = lambda request_id, num_tokens: False
        self.scheduler = Scheduler(SchedulerConfig(MAX_SEQS, 2048), self.kv_cache)
        self.next_id = 0
        for _ in range(running):
            self.admit()

    def admit(self) -> None:
        prompt, output = self.rng.randint(16, 400), self.rng.randint(100, 400)
        self.scheduler.add(Request(str(self.next_id), [1] * prompt, SamplingParams(), max_tokens=output))
        self.next_id += 1

    def round(self) -> float:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        getattr(self.kv_cache, "sync_device", lambda: None)()  # (before it: a copy each page allocation)
        if self.kv_cache.device_tables is not None and self.kv_cache.device_tables.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        for request, num_new in zip(batch.requests, batch.num_new_tokens):  # what the pass and the sampler do
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(1)
                if len(request.output_token_ids) >= request.max_tokens:
                    self.scheduler.finish(request, "length")
                    self.admit()
        return seconds


def older_manager(path: str):
    """The `KVCacheManager` class of another version of rimuru/kv_cache.py (`git show REV:rimuru/kv_cache.py`)."""
    spec = importlib.util.spec_from_file_location("kv_cache_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KVCacheManager


def summary(rounds: list[float]) -> dict:
    rounds = sorted(r * 1e6 for r in rounds)
    return {"round_us_median": round(statistics.median(rounds), 1), "round_us_mean": round(statistics.mean(rounds), 1),
            "round_us_p99": round(rounds[int(0.99 * (len(rounds) - 1))], 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=140)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the tables' copy lives; none: no copy (the scheduler's own Python alone)")
    parser.add_argument("--against", default=None, metavar="KV_CACHE_PY",
                        help="another version of rimuru/kv_cache.py, its rounds alternated with these in one process")
    args = parser.parse_args()
    device = None if args.device == "none" else torch.device(args.device)
    emulators = {"this": Emulator(args.running, args.seed, device)}
    if args.against:
        emulators["against"] = Emulator(args.running, args.seed, device, older_manager(args.against))
    for _ in range(400):  # the prompts' prefill rounds, then decodes in steady state
        for emulator in emulators.values():
            emulator.round()
    rounds = {name: [] for name in emulators}
    for _ in range(args.rounds):  # alternated: the machine's drift hits both alike
        for name, emulator in emulators.items():
            rounds[name].append(emulator.round())
    result = {"running": len(emulators["this"].scheduler.running), **summary(rounds["this"])}
    if args.against:
        result["against"] = summary(rounds["against"])
        result["ratio_of_medians"] = round(result["round_us_median"] / result["against"]["round_us_median"], 3)
    print(json.dumps(result | {"device": args.device, "cpu": platform.processor() or platform.machine()}))


if __name__ == "__main__":
    main()
