"""Several `rimuru bench` runs in one process, the checkpoint loaded once (on the H200 a dummy Qwen1.5-MoE takes
longer to load than some runs take to finish).

    python -m tools.engine.sweep MODEL --out-dir OUT --common "--stream s.jsonl --rate 10 --load-format dummy" \\
        --run resident="--expert-policy resident" --run fixed8="--expert-policy fixed --offload-per-layer 8"

Each run is `rimuru bench MODEL <common> <its flags> --out OUT/<name>.json`, with its output in OUT/<name>.log and
its wall-clock span in OUT/runs.txt.
`--repeat N` runs the whole list N times in turn (A B A B, so a drift of the machine hits every policy alike),
repeats named <name>-2, <name>-3, ..., and ends with each policy's output tokens/s and their spread.
`--profile "<flags>"` first writes the ranking (`--ranking`, default MODEL/expert_ranking.json) with
`rimuru profile MODEL <flags>` when there is none, and every run then reads that ranking.
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import shlex
import time

import torch

import rimuru.engine
from rimuru.serving.cli import main as rimuru_main


def run(name: str, argv: list[str], out_dir: str) -> int:
    gc.collect()  # the last run's engine: its pool and graphs go before the next one is built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start, began = time.perf_counter(), time.strftime("%H:%M:%S")
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log, contextlib.redirect_stdout(log):
        code = rimuru_main(argv)
    line = f"{name}: exit {code} in {time.perf_counter() - start:.0f} s, {began}-{time.strftime('%H:%M:%S')}"
    print(line, flush=True)
    with open(os.path.join(out_dir, "runs.txt"), "a") as runs:  # the wall-clock span of each run, in order
        runs.write(line + "\n")
    return code


def _check_first_load(check, *args) -> None:
    """The host-memory check on the first load only: the cached load reuses its host expert store."""
    if rimuru.engine.from_pretrained.cache_info().currsize == 0:
        check(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--common", default="", help="flags every run gets")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=FLAGS", help="one run; repeatable")
    parser.add_argument("--profile", default=None, help="flags of `rimuru profile` when the ranking is missing")
    parser.add_argument("--ranking", default=None, help="expert_ranking.json to write and read (default: MODEL's)")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole list this many times in turn")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rimuru.engine.from_pretrained = functools.lru_cache(maxsize=1)(rimuru.engine.from_pretrained)
    rimuru.engine.check_host_memory = functools.partial(_check_first_load, rimuru.engine.check_host_memory)
    ranking = args.ranking or os.path.join(args.model, "expert_ranking.json")
    if args.profile is not None and not os.path.exists(ranking):
        run("profile", ["profile", args.model, *shlex.split(args.profile), "--output", ranking], args.out_dir)
    common = [*shlex.split(args.common), *(["--expert-ranking", ranking] if os.path.exists(ranking) else [])]
    throughput: dict[str, list[float]] = {}
    for repeat in range(1, args.repeat + 1):
        for spec in args.run:
            name, _, flags = spec.partition("=")
            label = name if repeat == 1 else f"{name}-{repeat}"
            out = os.path.join(args.out_dir, f"{label}.json")
            if run(label, ["bench", args.model, *common, *shlex.split(flags), "--out", out], args.out_dir) == 0:
                with open(out) as f:
                    throughput.setdefault(name, []).append(json.load(f)["output_tokens_per_s"])
    if args.repeat > 1:
        for name, values in throughput.items():
            print(f"{name}: {' '.join(f'{v:.1f}' for v in values)} tok/s, spread {spread(values):.1%}", flush=True)


def spread(values: list[float]) -> float:
    """(max - min) / mean of repeated runs: what a difference between two policies must beat."""
    return (max(values) - min(values)) / (sum(values) / len(values)) if values else 0.0


if __name__ == "__main__":
    main()
