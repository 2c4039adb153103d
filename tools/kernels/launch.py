"""The host's time to launch the MoE op eagerly, beside the GPU's time for the same call from a CUDA graph.

    python -m tools.kernels.launch --out launch.json              # on a CUDA GPU (`device_session.sh launch`)
    TRITON_INTERPRET=1 python -m tools.kernels.launch --smoke     # logic check on CPU, times meaningless

Eager prefill and mixed steps launch the op from Python. Where the host's launch takes longer than the GPU's work,
the host is the bound: at M <= 4 two GEMM launches took 72-140 us eagerly at ace1e02 and 35-80 us from a graph
(`docs/benchmarks/kernels.md`). For each model and M, with the tuned config as it is and with `PDL` or `L2_HINTS`
turned off: the median host time of one call (the GPU drained before each, so the launch queue never pushes back),
for the two GEMM launches (`moe_gemms`) and for the whole op, and the GPU time of each from a graph.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from rimuru.ops.configs import moe_config
from rimuru.ops.moe_align import gemm_layout
from rimuru.ops.paged_moe import moe_gemms, paged_moe_triton
from tools.kernels.bench import MODELS, expert_pools, routing, time_graph_ms

VARIANTS = {"table": {}, "no PDL": {"PDL": False}, "no L2 hints": {"L2_HINTS": False}}
TINY = {"tiny": {"E": 6, "F": 40, "D": 72, "K": 2}}


def host_us(fn, calls: int, smoke: bool) -> float:
    """Median us the host spends in one call of `fn`, each started on an idle GPU."""
    times = []
    for _ in range(calls):
        if not smoke:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def launch_point(name, shape, num_tokens, pools, device, dtype, smoke):
    pool, table = pools[0], pools[1]
    ids, weights = routing(num_tokens, shape, device, seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device=device, dtype=dtype)
    tuned = moe_config(num_tokens, shape["E"], shape["F"], shape["D"], shape["K"], device)
    rows = []
    for variant, change in VARIANTS.items():
        cfg = {**tuned, **change}
        layout = gemm_layout(ids, shape["E"], cfg["BLOCK_M"], cfg.get("PAIR_BLOCKS"), cfg.get("ATOMIC_SORT", False))
        calls = {
            "gemms": lambda cfg=cfg, layout=layout: moe_gemms(hidden, pool, table, weights, *layout, shape["F"], cfg),
            "op": lambda cfg=cfg: paged_moe_triton(hidden, pool, table, ids, weights, shape["F"], cfg),
        }
        row = {"model": name, "M": num_tokens, "variant": variant, "config": cfg}
        for what, fn in calls.items():
            fn()  # compiled outside the timing
            row[f"{what}_host_us"] = host_us(fn, 3 if smoke else 200, smoke)
            row[f"{what}_graph_us"] = None if smoke else 1e3 * time_graph_ms(fn)
        rows.append(row)
    return rows


def print_rows(rows):
    print("model M variant | gemms: host graph | op: host graph  (us)")
    for r in rows:
        graphs = [f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("gemms_graph_us", "op_graph_us")]
        print(f"{r['model']} {r['M']} {r['variant']} | {r['gemms_host_us']:.1f} {graphs[0]} |"
              f" {r['op_host_us']:.1f} {graphs[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="launch.json")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    report = {"argv": sys.argv, "torch": torch.__version__, "commit": os.environ.get("RIMURU_COMMIT", "unknown")}
    if not args.smoke:
        report["gpu"] = torch.cuda.get_device_name()
    report["rows"] = []
    for name, shape in (TINY if args.smoke else MODELS).items():
        pools = expert_pools(shape, device, dtype)
        for m in args.m:
            report["rows"] += launch_point(name, shape, m, pools, device, dtype, args.smoke)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_rows(report["rows"])


if __name__ == "__main__":
    main()
