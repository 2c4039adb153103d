"""What reading host experts in place costs the MoE op (`expert_reads="direct"`), against copying them first.

    python -m tools.kernels.direct_reads --out direct_reads.json        # on a CUDA GPU
    TRITON_INTERPRET=1 python -m tools.kernels.direct_reads --smoke     # logic check on CPU, times meaningless

Per model shape (Qwen3-30B-A3B, Qwen1.5-MoE) and M = 1, 8, 64, 256 tokens: the whole `paged_moe` op with every
expert in the pool (`resident`), and with the N least-used routed experts on the host, read by the kernels from
pinned memory (`direct`, N = 1 and 4). The copy path's cost for the same N is the resident op plus N experts'
host -> device copies (`copy_ms`, timed in the same run from the same pinned memory, as the engine's miss path
does), before counting the host wait the copy path also needs. Outputs of direct and resident must be equal.
Times: medians of CUDA events (triton.testing.do_bench).
"""

import argparse
import json
import os
import sys

import torch

from rimuru.ops.paged_moe import paged_moe_triton
from tools.kernels.bench import MODELS, expert_pools, routing, time_ms

M_VALUES = (1, 8, 64, 256)
HOST_COUNTS = (1, 4)


def host_copies(view: torch.Tensor, table: torch.Tensor, shape: dict, pin: bool):
    """Pinned (gate [E, F, D], up [E, F, D], down [E, D, F]) holding what the pool holds."""
    e, f, d = shape["E"], shape["F"], shape["D"]
    pages = table.long()
    copies = [view[pages[:, m]].view(e, *dims).cpu() for m, dims in enumerate([(f, d), (f, d), (d, f)])]
    return tuple(c.pin_memory() if pin else c for c in copies)


def least_used(ids: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` routed experts with the fewest tokens (the ones an adjuster would have offloaded)."""
    experts, tokens = torch.unique(ids, return_counts=True)
    return experts[tokens.argsort()[:count]]


def bench_point(shape, num_tokens, pool, table, host, device, dtype, smoke) -> list[dict]:
    ids, weights = routing(num_tokens, shape, device, seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device=device, dtype=dtype)
    resident = paged_moe_triton(hidden, pool, table, ids, weights, shape["F"])
    resident_ms = time_ms(lambda: paged_moe_triton(hidden, pool, table, ids, weights, shape["F"]), smoke)
    scratch = torch.empty(3, shape["F"] * shape["D"], device=device, dtype=dtype)
    rows = []
    for count in HOST_COUNTS:
        on_host = least_used(ids, count)
        absent = table.clone()
        absent[on_host] = -1

        def copy():  # the miss path: each expert's three matrices into pool pages
            for e in on_host.tolist():
                for page, matrix in zip(scratch, (m[e] for m in host)):
                    page.copy_(matrix.reshape(-1), non_blocking=True)

        direct = paged_moe_triton(hidden, pool, absent, ids, weights, shape["F"], host=host)
        direct_ms = time_ms(lambda: paged_moe_triton(hidden, pool, absent, ids, weights, shape["F"], host=host), smoke)
        copy_ms = time_ms(copy, smoke)
        rows.append({"M": num_tokens, "on_host": len(on_host), "resident_ms": resident_ms, "direct_ms": direct_ms,
                     "copy_ms": copy_ms, "copy_path_ms": resident_ms + copy_ms,
                     "equal_to_resident": bool(torch.equal(direct, resident))})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="direct_reads.json")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    models = {"tiny": {"E": 6, "F": 40, "D": 72, "K": 2}} if args.smoke else MODELS
    report = {"argv": sys.argv, "torch": torch.__version__, "commit": os.environ.get("RIMURU_COMMIT", "unknown"),
              "gpu": torch.cuda.get_device_name() if not args.smoke else "cpu", "rows": []}  # fmt: skip
    for name, shape in models.items():
        pool, table, _, _ = expert_pools(shape, device, dtype)
        host = host_copies(pool, table, shape, pin=not args.smoke)
        for num_tokens in M_VALUES[:2] if args.smoke else M_VALUES:
            report["rows"] += [{"model": name} | row
                               for row in bench_point(shape, num_tokens, pool, table, host, device, dtype, args.smoke)]
        with open(args.out, "w") as f:  # partial results survive a time-out
            json.dump(report, f, indent=1)
    print("model M on_host | resident direct copy-path (ms) | equal")
    for r in report["rows"]:
        print(f"{r['model']} {r['M']} {r['on_host']} | {r['resident_ms']:.3f} {r['direct_ms']:.3f} "
              f"{r['copy_path_ms']:.3f} | {r['equal_to_resident']}")


if __name__ == "__main__":
    main()
