"""Several `rimuru bench` runs in one process, the checkpoint loaded once (on the H200 a dummy Qwen1.5-MoE takes
longer to load than some runs take to finish).

    python tools/bench_sweep.py MODEL --out-dir OUT --common "--stream s.jsonl --rate 10 --load-format dummy" \\
        --run resident="--expert-policy resident" --run fixed8="--expert-policy fixed --offload-per-layer 8"

Each run is `rimuru bench MODEL <common> <its flags> --out OUT/<name>.json`, with its output in OUT/<name>.log.
`--profile "<flags>"` first writes the ranking (`--ranking`, default MODEL/expert_ranking.json) with
`rimuru profile MODEL <flags>` when there is none, and every run then reads that ranking.
"""

import argparse
import contextlib
import functools
import gc
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
    start = time.perf_counter()
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log, contextlib.redirect_stdout(log):
        code = rimuru_main(argv)
    print(f"{name}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--common", default="", help="flags every run gets")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=FLAGS", help="one run; repeatable")
    parser.add_argument("--profile", default=None, help="flags of `rimuru profile` when the ranking is missing")
    parser.add_argument("--ranking", default=None, help="expert_ranking.json to write and read (default: MODEL's)")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rimuru.engine.from_pretrained = functools.lru_cache(maxsize=1)(rimuru.engine.from_pretrained)
    ranking = args.ranking or os.path.join(args.model, "expert_ranking.json")
    if args.profile is not None and not os.path.exists(ranking):
        run("profile", ["profile", args.model, *shlex.split(args.profile), "--output", ranking], args.out_dir)
    common = [*shlex.split(args.common), *(["--expert-ranking", ranking] if os.path.exists(ranking) else [])]
    for spec in args.run:
        name, _, flags = spec.partition("=")
        out = os.path.join(args.out_dir, f"{name}.json")
        run(name, ["bench", args.model, *common, *shlex.split(flags), "--out", out], args.out_dir)


if __name__ == "__main__":
    main()
