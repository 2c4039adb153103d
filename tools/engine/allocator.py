"""Time one realistic scheduling round of the PageAllocator on this CPU.

The round: 90 running requests each add a token; a request crossing a 16-token page boundary takes one KV page for
each of the 24 attention layers (Qwen1.5-MoE-A2.7B sizes: 44 KV pages an expert page); finished requests free all
their pages and new requests are admitted with their whole prompt; every fifth round one expert is evicted and
another added (the adjuster's traffic). Prints JSON: median, mean and p99 microseconds per round, and one
`stats()` call's microseconds at the end (metrics and `rimuru bench` read it every step).

    python -m tools.engine.allocator [--rounds 20000] [--seed 0]
"""

import argparse
import json
import platform
import random
import statistics
import time

import torch

from rimuru.memory import PageAllocator, page_sizes

LAYERS, PAGE_TOKENS, RUNNING = 24, 16, 90
SIZES = page_sizes((1408 * 2048,), (2, PAGE_TOKENS, 16, 128), torch.bfloat16)  # Qwen1.5-MoE-A2.7B


class Emulator:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.allocator = PageAllocator(SIZES, 3000 * SIZES.expert_page_bytes)
        self.experts = [(layer, e) for layer in range(LAYERS) for e in range(40)]
        self.experts = self.experts[:400]  # 1,200 expert pages resident, 1,800 (79,200 KV pages) left
        for owner in self.experts:
            self.allocator.allocate_expert(owner)
        self.evicted: list = []
        self.tokens: dict[int, list[int]] = {}  # request -> [tokens so far, tokens at finish]
        self.next_request = 0
        while len(self.tokens) < RUNNING and self.admit():
            pass

    def admit(self) -> bool:
        prompt = self.rng.randint(16, 400)
        request, self.next_request = self.next_request, self.next_request + 1
        if self.allocator.allocate(request, -(-prompt // PAGE_TOKENS) * LAYERS) is not None:
            self.tokens[request] = [prompt, prompt + self.rng.randint(16, 400)]
            return True
        return False

    def round(self, index: int) -> None:
        finished = []
        for request, state in self.tokens.items():
            if state[0] % PAGE_TOKENS == 0 and self.allocator.allocate(request, LAYERS) is None:
                finished.append(request)  # out of pages: preempted, freed like a finished one
                continue
            state[0] += 1
            if state[0] >= state[1]:
                finished.append(request)
        for request in finished:
            self.allocator.free(request)
            del self.tokens[request]
        while len(self.tokens) < RUNNING and self.admit():
            pass
        if index % 5 == 0:
            self.churn_experts()

    def churn_experts(self) -> None:
        victim = self.experts.pop(self.rng.randrange(len(self.experts)))
        self.allocator.free(victim)
        self.evicted.append(victim)
        back = self.evicted.pop(0)
        if self.allocator.allocate_expert(back) is not None:
            self.experts.append(back)
        else:
            self.evicted.append(back)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    emulator = Emulator(args.seed)
    times = []
    for index in range(args.rounds):
        start = time.perf_counter_ns()
        emulator.round(index)
        times.append((time.perf_counter_ns() - start) / 1000)
    emulator.allocator.check_integrity()
    times.sort()
    start = time.perf_counter_ns()
    for _ in range(1000):
        stats = emulator.allocator.stats()
    stats_us = (time.perf_counter_ns() - start) / 1000 / 1000
    print(json.dumps({
        "rounds": args.rounds,
        "median_us": round(statistics.median(times), 1),
        "mean_us": round(statistics.fmean(times), 1),
        "p99_us": round(times[int(0.99 * len(times))], 1),
        "stats_us": round(stats_us, 1),
        "requests_admitted": emulator.next_request,
        "kv_used_pages": stats["kv_used_pages"],
        "kv_trapped_pages": stats["kv_trapped_pages"],
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }, indent=1))


if __name__ == "__main__":
    main()
