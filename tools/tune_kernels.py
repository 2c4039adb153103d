"""Tune the paged MoE tiles per M bucket on this GPU; writes `ops/configs/<GPU name>.json`.

    python tools/tune_kernels.py [--budget-s 240] [--models qwen3-30b-a3b qwen1.5-moe]

For each model shape and M = 1, 2, 4, ..., 4096 it tries a few BLOCK_M values (the sort depends on it, so both
kernels share it) and, for each, times the gate/up and the down kernel separately over a small space of
(BLOCK_N, BLOCK_K, num_warps, num_stages); the best pair is stored, the down kernel's tiles as DOWN_* keys. Times are
medians of CUDA events (triton.testing.do_bench) on experts at shuffled pool pages. A bucket left when the budget
runs out is simply not stored (the lookup then falls back to the nearest tuned M, then to the heuristic).
"""

import argparse
import itertools
import json
import time

import torch
import triton.testing

from bench_kernels import M_VALUES, MODELS, expert_pools, routing
from rimuru.ops.configs import CONFIG_DIR, device_file_name
from rimuru.ops.moe_align import align_tokens
from rimuru.ops.paged_moe import launch_down, launch_gate_up


def search_space(tokens_per_expert):
    """(BLOCK_M values, kernel tile configs) for a load: decode is bandwidth bound, large M compute bound."""
    if tokens_per_expert <= 4:
        block_ms, tiles = [16], itertools.product([16, 32, 64], [128, 256], [4], [3, 5])
    elif tokens_per_expert <= 48:
        block_ms, tiles = [16, 32, 64], itertools.product([64, 128], [64, 128], [4, 8], [3])
    else:
        block_ms, tiles = [64, 128], itertools.product([64, 128], [64], [4, 8], [3, 4])
    keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return block_ms, [dict(zip(keys, t)) for t in tiles]


def best(fn_of_cfg, tiles):
    timed = []
    for tile in tiles:
        try:
            timed.append((triton.testing.do_bench(lambda: fn_of_cfg(tile), warmup=5, rep=20,
                                                  return_mode="median"), tile))
        except Exception:  # out of shared memory or registers: not a candidate
            continue
    return min(timed, key=lambda t: t[0])


def tune_point(shape, num_tokens, pools):
    pool, table = pools[0], pools[1]
    ids, weights = routing(num_tokens, shape, "cuda", seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device="cuda", dtype=torch.bfloat16)
    num_pairs = ids.numel()
    act = torch.empty(num_pairs, shape["F"], device="cuda", dtype=torch.bfloat16)
    out = torch.empty(num_pairs, shape["D"], device="cuda", dtype=torch.bfloat16)
    block_ms, tiles = search_space(num_pairs / shape["E"])
    choices = []
    for block_m in block_ms:
        aligned = align_tokens(ids, shape["E"], block_m)
        gate_up_ms, gate_up = best(lambda t: launch_gate_up(hidden, pool, table, *aligned, act, shape["K"],
                                                            {"BLOCK_M": block_m, **t}), tiles)
        down_ms, down = best(lambda t: launch_down(act, pool, table, *aligned, weights, out,
                                                   {"BLOCK_M": block_m, **t}), tiles)
        cfg = {"BLOCK_M": block_m, **gate_up, **{f"DOWN_{k}": v for k, v in down.items()}}
        choices.append((gate_up_ms + down_ms, cfg))
    return min(choices, key=lambda c: c[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    path = CONFIG_DIR / device_file_name(torch.cuda.get_device_name())
    table = json.loads(path.read_text()) if path.exists() else {}
    pools = {name: expert_pools(MODELS[name], "cuda", torch.bfloat16) for name in args.models}
    for m in M_VALUES:  # every model's small M first: decode matters most if the budget runs out
        for name in args.models:
            if time.monotonic() > deadline:
                print(f"budget spent: {name} stops before M={m}")
                continue
            shape = MODELS[name]
            ms, cfg = tune_point(shape, m, pools[name])
            table.setdefault(f"E={shape['E']},F={shape['F']},D={shape['D']}", {})[str(m)] = cfg
            print(f"{name} M={m}: {ms * 1e3:.1f} us {cfg}", flush=True)
            path.write_text(json.dumps(table, indent=1) + "\n")

if __name__ == "__main__":
    main()
