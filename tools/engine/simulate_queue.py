"""What a fixed KV capacity does to the queue: the engine's own `Scheduler` and `KVCacheManager` over a stream's
arrivals, with no model and no GPU (a step's time is a fitted line), seconds a run.

    python -m tools.engine.simulate_queue --stream .bench/stream-400-r0.jsonl --rate 10 --kv-pages 1100 1250 1400
    python -m tools.engine.simulate_queue ... --kv-pages 1100 --reserve 0.1 0.5      # admission that keeps growth room

Each step: the scheduler's round, then every scheduled request computes its tokens; a prefill that completes and
every decode add one output token (EOS ignored, `max_tokens` as the stream says, as `rimuru bench` runs it). A step
takes `--step-ms` + `--per-request-ms` x requests in it + `--per-prefill-token-ms` x prefill tokens. The defaults
are fitted to the cost rule's run at router skew 0.5 and 10 requests/s (`paper-scenario/skew0.5-cost-r10-9be869c.json.gz`:
a mean step of 12.1 ms at 23.8 running), whose KV cache held 1,070-1,300 pages of 16 tokens a layer while requests
waited: at 1,100 pages the simulation gives that run's queue back (`paper-scenario.md`, "The queue at a fixed
capacity"). Pages are counted for one layer (the engine takes the same number in every layer).

`--reserve R` admits a waiting request only while the free pages cover every running request's growth to R x its
remaining output (SGLang's `new_token_ratio` admission, a fixed ratio here): fewer preemptions, fewer admissions.
"""

import argparse
import json
import statistics
from collections import deque

from rimuru.benchmark import read_stream
from rimuru.kv_cache import KVCacheManager
from rimuru.memory import KV
from rimuru.request import Request
from rimuru.sampling_params import SamplingParams
from rimuru.scheduler import Scheduler, SchedulerConfig
from rimuru.serving.cli import _with_rate

PAGE_TOKENS = 16


class CountedPages:
    """A `PageAllocator` stand-in of `capacity` KV pages that only counts them (ids are never read here)."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.held = capacity, 0, {}

    def num_free_small_pages(self, kind: str = KV) -> int:
        return self.capacity - self.used

    def allocate(self, owner: str, count: int, kind: str = KV) -> list[int] | None:
        if count > self.num_free_small_pages():
            return None
        self.used += count
        self.held[owner] = self.held.get(owner, 0) + count
        return [0] * count

    def free(self, owner: str) -> None:
        self.used -= self.held.pop(owner, 0)

    def expert_pages_for(self, num_small_pages: int) -> int:
        return num_small_pages  # never asked: nothing here evicts experts


class ReservingScheduler(Scheduler):
    """Admits (in queue order, as the engine does) only while the free pages cover the running requests' and the
    admitted ones' growth to `ratio` x their remaining output."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, ratio: float):
        super().__init__(config, kv_cache)
        self.ratio = ratio

    def _pages_to_grow(self, request: Request) -> int:
        remaining = request.max_tokens - len(request.output_token_ids)
        target = request.num_tokens + int(remaining * self.ratio)
        return self.kv_cache.num_new_pages(request.request_id, target)

    def _schedule_waiting(self, batch, budget: int) -> None:
        room = self.kv_cache.allocator.num_free_small_pages() - sum(map(self._pages_to_grow, self.running))
        admissible = 0
        for request in self.waiting:
            room -= self._pages_to_grow(request)
            if room < 0 and (self.running or admissible):
                break
            admissible += 1
        queue = list(self.waiting)
        self.waiting = deque(queue[:admissible])  # the engine's own admission over the admissible ones
        super()._schedule_waiting(batch, budget)
        self.waiting.extend(queue[admissible:])


def simulate(stream: list[dict], kv_pages: int, args, reserve: float | None = None) -> dict:
    """Run the stream to the end over `kv_pages` pages; throughput, TTFT and preemptions."""
    kv = KVCacheManager(CountedPages(kv_pages), 1, PAGE_TOKENS, max_slots=args.max_num_seqs * 2, max_model_len=1 << 16)
    config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
    scheduler = Scheduler(config, kv) if reserve is None else ReservingScheduler(config, kv, reserve)
    now, arrived, first_token, pending, generated = 0.0, {}, {}, list(stream), 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            arrived[r["id"]] = r["arrival"]
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
            scheduler.add(Request(r["id"], r["prompt_token_ids"], params, r["max_tokens"]))
        if not scheduler.has_unfinished():
            now = pending[0]["arrival"]
            continue
        batch = scheduler.schedule()
        prefill_tokens = sum(n for n in batch.num_new_tokens if n > 1)
        now += (args.step_ms + args.per_request_ms * len(batch.requests)
                + args.per_prefill_token_ms * prefill_tokens) / 1e3  # fmt: skip
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk short of the prompt's end
            request.output_token_ids.append(0)
            generated += 1
            first_token.setdefault(request.request_id, now)
            if len(request.output_token_ids) >= request.max_tokens:
                scheduler.finish(request, "length")
    ttft = [first_token[i] - arrived[i] for i in first_token]
    return {"kv_pages": kv_pages, "reserve": reserve, "output_tokens": generated,
            "output_tok_s": round(generated / now),
            "wall_s": round(now, 1), "ttft_mean_s": round(statistics.mean(ttft), 2),
            "ttft_median_s": round(statistics.median(ttft), 2), "preemptions": scheduler.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="the stream's first N requests")
    parser.add_argument("--kv-pages", type=int, nargs="+", default=[1100])
    parser.add_argument("--reserve", type=float, nargs="*", default=[], help="also run ReservingScheduler at these")
    parser.add_argument("--step-ms", type=float, default=4.5)
    parser.add_argument("--per-request-ms", type=float, default=0.27)
    parser.add_argument("--per-prefill-token-ms", type=float, default=0.01)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    stream = _with_rate(read_stream(args.stream, args.limit), args.rate, args.seed)
    for kv_pages in args.kv_pages:
        for reserve in [None, *args.reserve]:
            print(json.dumps(simulate(stream, kv_pages, args, reserve)), flush=True)


if __name__ == "__main__":
    main()
