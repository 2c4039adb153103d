"""Tune the paged MoE tiles per M bucket on this GPU; writes `ops/configs/<GPU name>.json`.

    python -m tools.kernels.tune [--budget-s 240] [--models qwen3-30b-a3b qwen1.5-moe] [--m 1 2 4]
    python -m tools.kernels.tune --m 1 2 4 8 16 --out-dir $OUT      # $OUT/<GPU name>.json, from the table in use

For each model shape and M = 1, 2, 4, ..., 4096 it tries a few BLOCK_M values (the sort depends on it, so both
kernels share it) and, for each, times the gate/up and the down kernel separately over a small space of
(BLOCK_N, BLOCK_K, num_warps, num_stages, and at large M the program order GROUP_M); the best pair is stored, the
down kernel's tiles as DOWN_* keys. Up to 16 tokens the whole op is then timed sorted and one M block a pair, and
`PAIR_BLOCKS` stores which won; where the op sorts, `ATOMIC_SORT` stores whether the atomic sort beat count and
scatter; at every M, `PDL` whether dependent launches beat plain ones and `L2_HINTS` whether the GEMMs' L2
eviction hints beat none. Times are medians of CUDA events (triton.testing.do_bench) on experts at shuffled pool
pages. A bucket left when the budget runs out is simply not stored (the lookup then falls back to the nearest tuned
M, then to the heuristic). `--m` retunes only the buckets named (the others stay as the table has them); a
bucket's stored tiles compete with the search space, so a retune never stores anything slower than what it measured
for them.
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from rimuru.ops.configs import CONFIG_DIR, device_file_name, device_table
from rimuru.ops.moe_align import align_tokens, uses_pair_blocks
from rimuru.ops.paged_moe import launch_down, launch_gate_up, paged_moe_triton
from tools.kernels.bench import M_VALUES, MODELS, expert_pools, routing, time_graph_ms, time_ms

PAIR_LAYOUT_MAX_TOKENS = 16  # up to here the op is also timed one M block a pair (no sort): `PAIR_BLOCKS`


def search_space(tokens_per_expert, wide: bool = False):
    """(BLOCK_M values, kernel tile configs) for a load: decode is bandwidth bound, large M compute bound. `wide`
    (large M only): BLOCK_K 128, BLOCK_N 256 and 5 stages too, over the two program orders that won before."""
    if tokens_per_expert <= 4:  # weight streaming: narrow N tiles give more programs (88 at BLOCK_N 64, Qwen1.5 M=1)
        block_ms, tiles = [16], itertools.product([16, 32, 64], [128, 256], [2, 4], [3, 4, 6])
    elif tokens_per_expert <= 48:
        block_ms, tiles = [16, 32, 64], itertools.product([64, 128], [64, 128], [4, 8], [3])
    elif wide:  # the down GEMM at Qwen3's M = 1024 moved 3.3 TB/s where gate/up moved 3.5 (6cc8d03)
        block_ms, tiles = [128], itertools.product([64, 128, 256], [64, 128], [4, 8], [3, 4, 5], [0, 8])
    else:  # GROUP_M: the program order (`paged_moe._tile_ids`); 0 is M blocks fastest (8 won the down GEMM at
        # M = 1024-4096 on the H200 and lost gate/up at 4096 to 0, 7ed62cc: 4 and 16 lie between)
        block_ms, tiles = [64, 128], itertools.product([64, 128], [64], [4, 8], [3, 4], [0, 4, 8, 16, 32])
    keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M")
    return block_ms, [dict(zip(keys, t)) for t in tiles]


def best(fn_of_cfg, tiles, smoke=False):
    timed = []
    for tile in tiles:
        try:
            timed.append((time_ms(lambda: fn_of_cfg(tile), smoke, warmup=5, rep=20), tile))
        except Exception:  # out of shared memory or registers: not a candidate
            continue
    return min(timed, key=lambda t: t[0])


def stored_tiles(stored):
    """(gate/up tiles, down tiles) of a table entry, as search-space dicts."""
    keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M")
    entry = {"GROUP_M": 0, **stored}  # tables from before GROUP_M ran M blocks fastest
    return {k: entry[k] for k in keys}, {k: entry.get(f"DOWN_{k}", entry[k]) for k in keys}


def tune_point(shape, num_tokens, pools, stored=None, device="cuda", dtype=torch.bfloat16, smoke=False,
               wide=False):  # fmt: skip
    """(ms, config) of the best BLOCK_M and per-kernel tiles; `stored` (the table's entry) competes too."""
    pool, table = pools[0], pools[1]
    ids, weights = routing(num_tokens, shape, device, seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device=device, dtype=dtype)
    num_pairs = ids.numel()
    act = torch.empty(num_pairs, shape["F"], device=device, dtype=dtype)
    out = torch.empty(num_pairs, shape["D"], device=device, dtype=dtype)
    block_ms, tiles = search_space(num_pairs / shape["E"], wide)
    tiles = tiles[:2] if smoke else tiles
    if stored and stored["BLOCK_M"] not in block_ms:
        block_ms = block_ms + [stored["BLOCK_M"]]
    choices = []
    for block_m in block_ms:
        aligned = align_tokens(ids, shape["E"], block_m)
        gate_up_tiles, down_tiles = tiles, tiles
        if stored and stored["BLOCK_M"] == block_m:
            gate_up_tiles, down_tiles = (tiles + [t] for t in stored_tiles(stored))
        gate_up_ms, gate_up = best(lambda t: launch_gate_up(hidden, pool, table, *aligned, act, shape["K"],
                                                            {"BLOCK_M": block_m, **t}), gate_up_tiles, smoke)
        down_ms, down = best(lambda t: launch_down(act, pool, table, *aligned, weights, out,
                                                   {"BLOCK_M": block_m, **t}), down_tiles, smoke)
        cfg = {"BLOCK_M": block_m, **gate_up, **{f"DOWN_{k}": v for k, v in down.items()}}
        choices.append((gate_up_ms + down_ms, cfg))
    ms, cfg = min(choices, key=lambda c: c[0])
    if 1 < num_tokens <= PAIR_LAYOUT_MAX_TOKENS and not smoke:
        cfg["PAIR_BLOCKS"] = op_choice_wins("PAIR_BLOCKS", hidden, pool, table, ids, weights, shape["F"], cfg)
    if not uses_pair_blocks(num_tokens, cfg.get("PAIR_BLOCKS")) and not smoke:
        cfg["ATOMIC_SORT"] = op_choice_wins("ATOMIC_SORT", hidden, pool, table, ids, weights, shape["F"], cfg)
    if not smoke:
        cfg["PDL"] = op_choice_wins("PDL", hidden, pool, table, ids, weights, shape["F"], cfg)
        cfg["L2_HINTS"] = op_choice_wins("L2_HINTS", hidden, pool, table, ids, weights, shape["F"], cfg)
    return ms, cfg


def op_choice_wins(key, hidden, pool, table, ids, weights, num_features, cfg) -> bool:
    """Whether the whole op is faster with the config's `key` on than off, as 8 calls in a CUDA graph (what a step's
    graph holds). `PAIR_BLOCKS`: one M block a pair against sorted (the sort's launch against an expert two pairs
    share read twice); `ATOMIC_SORT`: the atomic sort against the count-and-scatter one; `PDL`: every launch
    dependent on the one before it against plain launches; `L2_HINTS`: the GEMMs' eviction hints against none."""
    def op(on):
        return lambda: paged_moe_triton(hidden, pool, table, ids, weights, num_features, {**cfg, key: on})

    return time_graph_ms(op(True), calls=8) < time_graph_ms(op(False), calls=8)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--m", nargs="*", type=int, default=M_VALUES, help="the M buckets to (re)tune")
    parser.add_argument("--out", help="table to update (default: ops/configs/<GPU name>.json; none with --smoke)")
    parser.add_argument("--out-dir", help="write <GPU name>.json here instead, starting from the table this GPU "
                                          "uses now (its own, else its architecture's: rimuru.ops.configs)")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1, tiny shape")
    parser.add_argument("--wide", action="store_true", help="a wider tile space at large M (`search_space`)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    models = {"tiny": {"E": 6, "F": 40, "D": 72, "K": 2}} if args.smoke else {n: MODELS[n] for n in args.models}
    path = Path(args.out) if args.out else None if args.smoke else CONFIG_DIR / device_file_name(
        torch.cuda.get_device_name())
    table = json.loads(path.read_text()) if path and path.exists() else {}
    if args.out_dir and not args.smoke:
        name = torch.cuda.get_device_name()
        path = Path(args.out_dir) / device_file_name(name)
        table = json.loads(json.dumps(device_table(name, torch.cuda.get_device_capability())))  # a copy to edit
    pools = {name: expert_pools(shape, device, dtype) for name, shape in models.items()}
    for m in sorted(args.m[:2] if args.smoke else args.m):  # small M first: decode matters most if the budget ends
        for name, shape in models.items():
            if time.monotonic() > deadline:
                print(f"budget spent: {name} stops before M={m}")
                continue
            buckets = table.setdefault(f"E={shape['E']},F={shape['F']},D={shape['D']}", {})
            ms, cfg = tune_point(shape, m, pools[name], buckets.get(str(m)), device, dtype, args.smoke, args.wide)
            print(f"{name} M={m}: {ms * 1e3:.1f} us (was {buckets.get(str(m))}) {cfg}", flush=True)
            buckets[str(m)] = cfg
            if path:
                path.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
