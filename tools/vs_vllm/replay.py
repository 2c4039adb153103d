#!/usr/bin/env python3
"""The stream `rimuru bench` replays, replayed at its arrival times into vLLM's in-process engine (add_request and
step), for the side-by-side benchmark (`tools/vs_vllm/table.py`). vLLM is a benchmark-only tool here, never a dependency
of Rimuru: this file runs on the GPU machine with vLLM carried there (`tools/device_session.sh vsvllm`).

    python -m tools.vs_vllm.replay MODEL_DIR --budget-gib 30 --stream a.jsonl --stream b.jsonl --out-dir OUT

Dummy weights from a config folder (or the folder's own safetensors, as tools/vs_vllm/checkpoint.py writes them for
both engines), prompts as token ids, greedy with ignore_eos (as `rimuru bench`), vLLM's
defaults otherwise (torch.compile, full and piecewise CUDA graphs, chunked prefill at 2,048 batched tokens, 256
sequences) but prefix caching, which random prompts never hit. `gpu_memory_utilization` is the budget over the
GPU's memory, so vLLM and `rimuru bench --gpu-memory-budget` get the same bytes. Writes OUT/vllm-<stream>.json per
stream: throughput, TTFT / TPOT (mean, median, p99), preemptions (vLLM's own counter), KV tokens, peak running.
"""

import argparse
import json
import os
import statistics
import time

from vllm import EngineArgs, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine


def summary(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": round(statistics.fmean(values), 5), "median": round(statistics.median(values), 5),
            "p99": round(values[min(len(values) - 1, int(0.99 * len(values)))], 5)}  # fmt: skip


def metric(engine: LLMEngine, name: str) -> float:
    """A counter or gauge of vLLM's metrics (its Prometheus names without `_total`), summed over engines."""
    return sum(getattr(m, "value", 0) for m in engine.get_metrics() if m.name == name)


def replay(engine: LLMEngine, requests: list[dict]) -> dict:
    requests = sorted(requests, key=lambda r: r["arrival"])
    preempted_before = metric(engine, "vllm:num_preemptions")
    start, i, first, last, count, arrival, peak, steps = time.perf_counter(), 0, {}, {}, {}, {}, 0, 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(requests) and requests[i]["arrival"] <= now:
            r = requests[i]
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, params)
            arrival[r["id"]], i = r["arrival"], i + 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(requests[i]["arrival"] - now, 0.01)))
            continue
        outputs = engine.step()
        steps += 1
        t = time.perf_counter() - start
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = t
            if n:
                last[out.request_id], count[out.request_id] = t, n
        if steps % 16 == 0:
            peak = max(peak, int(metric(engine, "vllm:num_requests_running")))
    wall = time.perf_counter() - start
    tokens = sum(count.values())
    return {"requests": len(requests), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 2), "forward_steps": steps, "peak_concurrency": peak,
            "preemptions": int(metric(engine, "vllm:num_preemptions") - preempted_before),
            "ttft_s": summary([first[r] - arrival[r] for r in first]),
            "tpot_s": summary([(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1])}  # fmt: skip


def kv_tokens(engine: LLMEngine) -> int | None:
    cache = engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget-gib", type=float, required=True)
    parser.add_argument("--stream", action="append", required=True, help="a JSONL stream; repeatable")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs vLLM splits the model over")
    args = parser.parse_args()
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    utilization = args.budget_gib * 2**30 / total
    weights = any(name.endswith(".safetensors") for name in os.listdir(args.model))  # else draw vLLM's own
    engine_args = EngineArgs(model=args.model, load_format="auto" if weights else "dummy", skip_tokenizer_init=True,
                             dtype="bfloat16",
                             gpu_memory_utilization=utilization, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
                             max_model_len=args.max_model_len, disable_log_stats=False, seed=0,
                             tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    startup = round(time.perf_counter() - started, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    import vllm

    for stream in args.stream:  # each request arrives at its own `arrival`, as `rimuru bench` replays it
        with open(stream) as f:
            requests = [json.loads(line) for line in f if line.strip()]
        warm = [dict(r, max_tokens=2, arrival=0.0, id=f"warm-{k}") for k, r in enumerate(requests[:8])]
        replay(engine, warm)  # as `rimuru bench --warmup`
        record = replay(engine, requests)
        record |= {"engine": "vllm", "vllm": vllm.__version__, "stream": stream, "rate": None,
                   "budget_gib": args.budget_gib, "gpu_memory_utilization": round(utilization, 5),
                   "kv_tokens": kv_tokens(engine), "startup_s": startup, "model": args.model,
                   "device": torch.cuda.get_device_name()}  # fmt: skip
        name = os.path.splitext(os.path.basename(stream))[0]
        with open(os.path.join(args.out_dir, f"vllm-{name}.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
