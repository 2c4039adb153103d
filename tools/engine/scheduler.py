"""Time one decode-heavy scheduling round of the `Scheduler` on this host, with the page tables' device copy.

The round: `--running` requests (default 140, the paper scenario's peak) each decode a token; one crossing a 16-token
page boundary takes a KV page in each of the 24 attention layers (Qwen1.5-MoE-A2.7B sizes); a request finishing
frees its pages and a new one (16-400 prompt tokens, 100-400 output) takes its place. A round is
`Scheduler.schedule()` then `KVCacheManager.sync_device()` (`round_us`), then the pass's inputs made from the
batch (`model_runner.step_inputs`, `prepare_us`): the host's work before a pass. The page tables' device copy lives
on `--device` (default: the GPU when there is one, as the engine keeps it under CUDA graphs; on the CPU a test-only
path, each copy a memcpy; `none`: no copy). `--against` alternates the rounds with older versions of
rimuru/kv_cache.py (and rimuru/model_runner.py) in the same process. Prints JSON: medians, mean and p99 in us.

    python -m tools.engine.scheduler [--running 140] [--rounds 3000] [--seed 0] [--device cuda|cpu|none]
        [--max-model-len 4096]
    git show 026cd3f:rimuru/kv_cache.py > /tmp/kv_old.py
    git show 0d983eb:rimuru/model_runner.py > /tmp/runner_old.py
    python -m tools.engine.scheduler --device none --against /tmp/kv_old.py --against-runner /tmp/runner_old.py
"""

import argparse
import json
import platform
import random
import statistics
import time

import torch

from rimuru.kv_cache import KVCacheManager
from rimuru.memory import PageAllocator, page_sizes
from rimuru.model_runner import step_inputs
from rimuru.request import Request
from rimuru.sampling_params import SamplingParams
from rimuru.scheduler import Scheduler, SchedulerConfig
from tools.records import load_version

LAYERS, PAGE_TOKENS, MAX_SEQS = 24, 16, 256
SIZES = page_sizes((1408 * 2048,), (2, PAGE_TOKENS, 16, 128), torch.bfloat16)  # Qwen1.5-MoE-A2.7B


class Emulator:
    def __init__(self, running: int, seed: int, device: torch.device | None, kv_cache_class=KVCacheManager,
                 runner_class=None, max_model_len: int = 4096):  # fmt: skip
        self.rng = random.Random(seed)
        allocator = PageAllocator(SIZES, 3000 * SIZES.expert_page_bytes)
        for owner in [(layer, e) for layer in range(LAYERS) for e in range(16)]:  # 1,152 expert pages resident
            allocator.allocate_expert(owner)
        self.kv_cache = kv_cache_class(allocator, LAYERS, PAGE_TOKENS, MAX_SEQS, max_model_len,
                                       device_copy=device)  # device None: no copy; max_model_len: the tables' width
        self.scheduler = Scheduler(SchedulerConfig(MAX_SEQS, 2048), self.kv_cache)
        self.prepare = lambda batch: step_inputs(batch, self.kv_cache.slot)
        if runner_class is not None:  # another ModelRunner: its `prepare` reads `kv_cache` (and `states`, none here)
            runner = runner_class.__new__(runner_class)
            runner.kv_cache, runner.states, self.prepare = self.kv_cache, None, runner.prepare
        self.next_id = 0
        for _ in range(running):
            self.admit()

    def admit(self) -> None:
        prompt, output = self.rng.randint(16, 400), self.rng.randint(100, 400)
        self.scheduler.add(Request(str(self.next_id), [1] * prompt, SamplingParams(), max_tokens=output))
        self.next_id += 1

    def round(self) -> tuple[float, float]:
        """(seconds scheduling, seconds making the pass's inputs)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        getattr(self.kv_cache, "sync_device", lambda: None)()  # (before it: a copy each page allocation)
        if self.kv_cache.device_tables is not None and self.kv_cache.device_tables.is_cuda:
            torch.cuda.synchronize()
        scheduled = time.perf_counter()
        self.prepare(batch)
        seconds = (scheduled - start, time.perf_counter() - scheduled)
        for request, num_new in zip(batch.requests, batch.num_new_tokens):  # what the pass and the sampler do
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(1)
                if len(request.output_token_ids) >= request.max_tokens:
                    self.scheduler.finish(request, "length")
                    self.admit()
        return seconds


def summary(rounds: list[tuple[float, float]]) -> dict:
    schedule = sorted(r[0] * 1e6 for r in rounds)
    prepare = [r[1] * 1e6 for r in rounds]
    return {
        "round_us_median": round(statistics.median(schedule), 1),
        "round_us_mean": round(statistics.mean(schedule), 1),
        "round_us_p99": round(schedule[int(0.99 * (len(schedule) - 1))], 1),
        "prepare_us_median": round(statistics.median(prepare), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=140)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096, help="the page tables' width (Qwen3: 40960)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the tables' copy lives; none: no copy (the scheduler's own Python alone)")
    parser.add_argument("--against", default=None, metavar="KV_CACHE_PY",
                        help="another version of rimuru/kv_cache.py, its rounds alternated with these in one process")
    parser.add_argument("--against-runner", default=None, metavar="MODEL_RUNNER_PY",
                        help="with --against: that version's rimuru/model_runner.py makes its rounds' inputs")
    args = parser.parse_args()
    device = None if args.device == "none" else torch.device(args.device)
    emulators = {"this": Emulator(args.running, args.seed, device, max_model_len=args.max_model_len)}
    if args.against:
        runner = load_version(args.against_runner, "runner_against").ModelRunner if args.against_runner else None
        kv_cache = load_version(args.against, "kv_cache_against").KVCacheManager
        emulators["against"] = Emulator(args.running, args.seed, device, kv_cache, runner, args.max_model_len)
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
        result["prepare_ratio"] = round(result["prepare_us_median"] / result["against"]["prepare_us_median"], 3)
    print(json.dumps(result | {"device": args.device, "cpu": platform.processor() or platform.machine()}))


if __name__ == "__main__":
    main()
