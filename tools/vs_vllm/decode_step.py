#!/usr/bin/env python3
"""vLLM's decode step at a fixed batch, the counterpart of `tools/engine/profile_step.py`'s "decode step" line:
the same stream's first B prompts admitted, prefilled, then S steps of B decoding requests timed on the host (each
`step` returns the sampled tokens, so it waits for the GPU).

    python tools/vs_vllm/decode_step.py MODEL_DIR --budget-gib 30 --stream s.jsonl --batch 1 16 64 256 --out f.json

Runs where vLLM is importable (`tools/device_session.sh stepvs`); one engine for every batch (max_num_seqs = the
largest), dummy weights, vLLM's defaults otherwise as in replay.py. `--profile` then runs PROFILE_STEPS more steps
a batch under the torch profiler and prints its kernel table (the engine core in this process, so the profiler
sees its kernels: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine

STEPS = 20
PROFILE_STEPS = 10


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]], steps: int, tag: str, profile: str | None = None) -> float:
    """Median host time of `steps` steps of len(prompts) requests, all decoding (prefill steps run first); with
    `profile` (a trace path), PROFILE_STEPS more under the torch profiler, its table printed and its trace written."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=steps + PROFILE_STEPS + 64, ignore_eos=True, temperature=0.0, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    generated = dict.fromkeys(range(len(prompts)), 0)
    while min(generated.values()) == 0:  # until every request has its first token: all of them decode from here
        for out in engine.step():
            generated[int(out.request_id.rsplit("-", 1)[1])] = len(out.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    if profile:
        print_kernel_table(engine, len(prompts), profile)
    for i in range(len(prompts)):
        engine.abort_request([f"{tag}-{i}"])
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def print_kernel_table(engine: LLMEngine, batch: int, trace: str) -> None:
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(PROFILE_STEPS):
            engine.step()
    print(f"kernels of {PROFILE_STEPS} decode steps, {batch} running:", flush=True)
    print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=60,
                                                max_name_column_width=140), flush=True)
    profiler.export_chrome_trace(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget-gib", type=float, required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=None, help="every prompt cycled to this many tokens")
    parser.add_argument("--profile", action="store_true",
                        help="print each batch's kernel table, its trace beside --out")
    args = parser.parse_args()
    if args.profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM's import: its engine core in this process
    import torch
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with open(args.stream) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    if args.context:  # as tools/engine/profile_step.py's --context
        prompts = [(p * -(-args.context // len(p)))[: args.context] for p in prompts]
    utilization = args.budget_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        gpu_memory_utilization=utilization, max_num_seqs=max(args.batch), enable_prefix_caching=False,
        max_model_len=max(2048, (args.context or 0) + STEPS + 128), seed=0))  # fmt: skip
    rows = []
    for batch in args.batch:
        trace = args.out.removesuffix(".json") + f"-trace-{batch}.json" if args.profile else None
        ms = decode_step_ms(engine, prompts[:batch], STEPS, f"b{batch}", trace)
        rows.append({"engine": "vllm", "batch": batch, "context": args.context, "decode_step_ms": round(ms, 3)})
        print(f"decode step, {batch} running: {ms:.2f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "budget_gib": args.budget_gib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
