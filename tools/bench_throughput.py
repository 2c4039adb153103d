"""Offline throughput: every request of a JSONL stream submitted at once, EOS ignored, output tokens per second.

The stream format is `shared/workloads/sharegpt_synth.py`'s: one JSON object a line with `prompt_token_ids` and
`max_tokens` (any user trace in that shape works). Engine options are the `rimuru generate` flags.

    python tools/bench_throughput.py MODEL_DIR --stream stream.jsonl --load-format dummy --out result.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from rimuru import LLM, SamplingParams
from rimuru.serving.cli import add_engine_arguments, engine_options


def read_stream(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    return requests[:limit] if limit else requests


def run(llm: LLM, requests: list[dict]) -> dict:
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    steps_before = llm.engine.num_steps
    experts_before = llm.engine.expert_stats
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    _sync()
    wall = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == sum(r["max_tokens"] for r in requests), "a request stopped early"
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": num_output,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(num_output / wall, 1),
        "forward_steps": llm.engine.num_steps - steps_before,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "peak_running": llm.engine.peak_running,
        "experts": {k: v for k, v in llm.engine.expert_stats.items() if not k.startswith(("ssm", "conv"))},
        "bytes_copied_during_run": llm.engine.expert_stats["bytes_copied"] - experts_before["bytes_copied"],
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--out", default=None)
    add_engine_arguments(parser)
    args = parser.parse_args()
    llm = LLM(args.model, **engine_options(args))
    requests = read_stream(args.stream, args.num_requests)
    run(llm, [dict(r, max_tokens=4) for r in requests[:8]])  # warm-up: kernel compilation and autotuning
    llm.engine.peak_running = 0
    result = run(llm, requests)
    result |= {
        "model": args.model,
        "engine": {k: str(v) for k, v in engine_options(args).items()},
        "pool_bytes": llm.engine.pool.num_bytes,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "commit": os.environ.get("RIMURU_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                     capture_output=True, text=True).stdout.strip(),
        "command": " ".join(sys.argv),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip tearing down tens of GB of pinned host memory: the numbers are written


if __name__ == "__main__":
    main()
