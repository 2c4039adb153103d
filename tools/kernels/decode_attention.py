"""Sweep the decode-only attention variants (`rimuru.ops.decode_attention`) against the general kernel, one GPU run.

    python -m tools.kernels.decode_attention --out decode_sweep.json               # on a CUDA GPU, about 90 s
    TRITON_INTERPRET=1 python -m tools.kernels.decode_attention --smoke            # logic check on CPU, tiny shapes

Target shape (issue 4): batch 64 x 1024-token contexts, Hq 32, Hk 4, Dh 128, 16-token pages in shuffled order,
bf16; bytes = K and V of every context token once + queries and outputs (`bench_kernels.decode_inputs`). The
device-to-device copy rate is measured in the same run. Stages, each checked against the fp32 reference
(relative error < 1e-2) before it is timed:
  1. the general kernel (`paged_attention_triton` with the decode kernel kept out) at the dispatcher's tiles, and
     the dispatcher itself (unsplit decode batches run the decode kernel since 40549f2)
  2. the decode kernel at those tiles (128 tokens, 8 warps, 2 stages), each flag alone, then all of them
  3. tiles (BLOCK_N, warps, stages) with PREFETCH_PAGES + EVEN_TILES + HEADS_FASTEST: page ids loaded a tile
     ahead let Triton's pipeliner keep num_stages - 1 K/V tiles in flight (without it K/V stay single-buffered)
  4. the best tile of stage 3 without HEADS_FASTEST, and persistent at 1, 2, 3 programs an SM
  5. the general kernel with PREFETCH_PAGES (`attend_pages`, also prefill's and split-KV's loop) at some of those
     tiles: if it comes close, the decode default can stay in the general kernel (a config change, no new dispatch)
  6. the general kernel's dispatch (split-KV for B = 1 and 8), the same with PREFETCH_PAGES at 3 stages, the two
     best decode variants and the best of stage 5 at other batch sizes and context lengths
Each row has the compiled kernel's shared memory and registers a thread, and the programs an SM that allows
(an H200 SM: 228 KB shared memory, 64K registers, 64 warps). Times are medians of CUDA events over replays of a
CUDA graph holding one call (triton.testing.do_bench, L2 flushed before each run), so no row counts host time:
the engine runs decode steps as graphs too. One row of the target shape replays a graph of DENSE_CALLS calls and
gives a call's share: a one-call replay carries the graph's own launch (4.7 us for an almost empty graph on the
H200), which a step's graph pays once, not per kernel. Those calls read the same K/V; another row gives each call
a K/V set of its own, as a step's graph does across layers, so no call can find its pages in L2. `--eager` times
the calls themselves.
"""

import argparse
import json
import os
import sys

import torch
import triton

from rimuru.ops import reference
from rimuru.ops.decode_attention import decode_attention_triton, decode_config
from rimuru.ops.paged_attention import default_config, paged_attention_triton
from tools.kernels.bench import copy_bandwidth, decode_inputs, time_graph_ms, time_ms

ALL_FLAGS = {"HEADS_FASTEST": True, "EVEN_TILES": True, "PREFETCH_PAGES": True}
PIPELINED_TILES = [(128, 8, 3), (128, 4, 3), (128, 8, 4), (64, 4, 3), (64, 4, 4), (64, 8, 4), (64, 4, 5),
                   (32, 4, 4), (32, 4, 6)]
OTHER_SHAPES = [(32, 1024), (128, 1024), (64, 4096), (256, 512), (64, 1000), (8, 4096), (1, 8192)]
GENERAL_PREFETCH_TILES = [(128, 8, 2), (128, 8, 3), (64, 4, 3), (64, 4, 4), (32, 4, 6)]
SM_SHARED_BYTES, SM_REGISTERS, SM_WARPS = 228 * 1024, 65536, 64
DENSE_CALLS = 8  # calls in one graph for the in-graph row of the target shape


def programs_per_sm(kernel, num_warps):
    """Resident programs an SM allows by shared memory, registers and warps (1 KB reserved a program)."""
    by_smem = SM_SHARED_BYTES // (kernel.metadata.shared + 1024)
    by_regs = SM_REGISTERS // max(1, kernel.n_regs * 32 * num_warps)
    return min(by_smem, by_regs, SM_WARPS // num_warps)


class Sweep:
    """One input set, its reference, and the rows timed on it."""

    def __init__(self, batch, context, device, dtype, smoke, copy_tb_per_s, graphs=True):
        self.args, self.moved = decode_inputs(batch, context, device, dtype, smoke)
        self.smoke, self.copy_tb_per_s, self.graphs = smoke, copy_tb_per_s, graphs and not smoke
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count if not smoke else 2
        fp32 = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in self.args]
        self.ref = reference.paged_attention(*fp32)
        self.rows = []

    def general(self, name, cfg=None):
        """The general kernel: `cfg`, else the dispatcher's tiles with the decode kernel kept out."""
        cfg = cfg or default_config(*self.args[:3], self.args[3].shape[0]) | {"DECODE": None}
        return self.measure(name, cfg, lambda: (paged_attention_triton(*self.args, config=cfg), None))

    def dispatched(self, name, calls=1):
        """Whatever `rimuru::paged_attention` runs for this batch (the engine's decode path); `calls` a graph."""
        return self.measure(name, "dispatcher", lambda: (paged_attention_triton(*self.args), None), calls)

    def dispatched_layers(self, name, layers):
        """The dispatcher over `layers` input sets of their own (as a step's graph calls it, a layer's K/V each: no
        call finds another's pages in L2), a graph of all of them, a call's share; the first set is checked."""
        sets = [self.args] + [decode_inputs(self.args[0].shape[0], int(self.args[3][0]), self.args[0].device,
                                            self.args[0].dtype, self.smoke)[0] for _ in range(layers - 1)]  # fmt: skip
        return self.measure(name, "dispatcher", lambda: ([paged_attention_triton(*a) for a in sets][0], None), 1,
                            layers)

    def decode(self, name, cfg):
        query, kv_view, page_table, seq_lens, _, scale = self.args
        return self.measure(name, cfg, lambda: decode_attention_triton(query, kv_view, page_table, seq_lens, scale,
                                                                       cfg, self.num_sms))

    def measure(self, name, cfg, run, calls=1, calls_a_run=1):
        """Check `run`'s output, then time it (`calls` runs a graph; `calls_a_run` kernel calls a run): a call's
        share."""
        row = {"name": name, "config": cfg, "batch": self.args[0].shape[0], "context": int(self.args[3][0]),
               "calls_a_graph": calls * calls_a_run}
        try:
            out, kernel = run()
        except Exception as error:  # a tile that does not fit (shared memory, registers) is a row, not a crash
            self.rows.append(row | {"error": str(error)[:300]})
            return self.rows[-1]
        row["rel_err"] = ((out.float() - self.ref).norm() / self.ref.norm()).item()
        if kernel is not None and not self.smoke:
            row |= {"shared_bytes": kernel.metadata.shared, "regs": kernel.n_regs, "spills": kernel.n_spills,
                    "programs_per_sm": programs_per_sm(kernel, cfg["num_warps"])}
        if not row["rel_err"] < 1e-2:  # NaN fails too
            self.rows.append(row | {"error": "output differs from the reference"})
            return self.rows[-1]
        if self.graphs:
            row["us"] = 1e3 * time_graph_ms(lambda: run(), calls) / calls_a_run
        else:
            row["us"] = 1e3 * time_ms(lambda: run(), self.smoke, warmup=5, rep=20) / calls_a_run
        row["tb_per_s"] = self.moved / row["us"] / 1e6
        if self.copy_tb_per_s:
            row["of_copy"] = row["tb_per_s"] / self.copy_tb_per_s
        self.rows.append(row)
        print_row(row)
        return row


def tile_config(tile, **flags):
    block_n, warps, stages = tile
    return decode_config(BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags)


def general_config(sweep, tile):
    block_n, warps, stages = tile
    group = triton.next_power_of_2(sweep.args[0].shape[1] // sweep.args[1].shape[3])
    return {"BLOCK_Q": max(1, 16 // group), "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
            "NUM_SPLITS": 1, "PREFETCH_PAGES": True}


def fastest(rows):
    timed = [r for r in rows if "us" in r]
    return min(timed, key=lambda r: r["us"]) if timed else None


def sweep_target(sweep, smoke):
    """Stages 1 to 5 at the target shape; returns the two fastest decode-kernel configs and the fastest general one."""
    sweep.general("general, default tiles")
    sweep.dispatched("dispatcher (the engine's decode path)")
    # the same as a step's graph holds it: calls back to back (134 MB of K/V a call, well over the H200's 50 MB L2,
    # so no call finds the previous one's pages there), a call's share
    sweep.dispatched(f"dispatcher, {DENSE_CALLS} calls a graph (a call's share)", DENSE_CALLS)
    sweep.dispatched_layers(f"dispatcher, {DENSE_CALLS} layers' K/V in one graph (a call's share)", DENSE_CALLS)
    base = (16, 4, 1) if smoke else (128, 8, 2)
    sweep.decode("decode, no flags", tile_config(base))
    for flag in ALL_FLAGS:
        sweep.decode(f"decode, {flag}", tile_config(base, **{flag: True}))
    sweep.decode("decode, all flags", tile_config(base, **ALL_FLAGS))
    for tile in [(16, 4, 2)] if smoke else PIPELINED_TILES:
        sweep.decode(f"decode, all flags, tile {tile}", tile_config(tile, **ALL_FLAGS))
    best = fastest([r for r in sweep.rows if r["name"].startswith("decode, all flags")])
    if best is None:
        return []
    tile = (best["config"]["BLOCK_N"], best["config"]["num_warps"], best["config"]["num_stages"])
    sweep.decode(f"decode, best tile {tile} without HEADS_FASTEST",
                 tile_config(tile, **(ALL_FLAGS | {"HEADS_FASTEST": False})))
    for per_sm in (1, 2, 3):
        sweep.decode(f"decode, best tile {tile}, persistent x{per_sm}",
                     tile_config(tile, **ALL_FLAGS, PERSISTENT=True, PROGRAMS_PER_SM=per_sm))
    decode_rows = sorted((r for r in sweep.rows if r["name"].startswith("decode") and "us" in r),
                         key=lambda r: r["us"])
    general = [sweep.general(f"general, PREFETCH_PAGES, tile {tile}", general_config(sweep, tile))
               for tile in ([(16, 4, 2)] if smoke else GENERAL_PREFETCH_TILES)]
    return [r["config"] for r in decode_rows[:2]] + [r["config"] for r in [fastest(general)] if r]


def sweep_shapes(finalists, device, dtype, smoke, copy_tb_per_s, graphs):
    """Stage 6: the general kernel's dispatch (split-KV where it splits) against the finalists."""
    rows = []
    for batch, context in [(2, 40)] if smoke else OTHER_SHAPES:
        sweep = Sweep(batch, context, device, dtype, smoke, copy_tb_per_s, graphs)
        dispatched = default_config(*sweep.args[:3], batch) | {"DECODE": None}
        sweep.dispatched("dispatcher (the engine's decode path)")
        sweep.general(f"general, dispatcher ({dispatched['NUM_SPLITS']} split(s))")
        sweep.general("general, dispatcher + PREFETCH_PAGES, 3 stages",
                      dispatched | {"PREFETCH_PAGES": True, "num_stages": 3 if not smoke else 2})
        for i, cfg in enumerate(finalists):
            if "NUM_SPLITS" in cfg:  # the general kernel's config
                sweep.general("general, PREFETCH_PAGES finalist", cfg)
            else:
                sweep.decode(f"decode finalist {i + 1}", cfg)
        rows += sweep.rows
    return rows


def print_row(r):
    share = f" {100 * r['of_copy']:.0f}%" if "of_copy" in r else ""
    res = f" smem {r['shared_bytes'] / 1024:.0f}K regs {r['regs']} x{r['programs_per_sm']}/SM" if "regs" in r else ""
    cfg = r["config"] if isinstance(r["config"], str) else {k: v for k, v in r["config"].items() if v is not False}
    print(f"B={r['batch']} ctx={r['context']} {r['name']}: {r['us']:.1f} us {r['tb_per_s']:.2f} TB/s{share}"
          f" err {r['rel_err']:.1e}{res} | {cfg}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="decode_sweep.json")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1")
    parser.add_argument("--eager", action="store_true", help="time the calls, not CUDA graph replays of them")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    report = {"argv": sys.argv, "torch": torch.__version__, "commit": os.environ.get("RIMURU_COMMIT", "unknown"),
              "timing": "calls" if args.eager else "CUDA graph replays"}
    if not args.smoke:
        report |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_tb_per_s": copy_bandwidth()}
        print(f"device-to-device copy: {report['copy_tb_per_s']:.2f} TB/s")
    copy = report.get("copy_tb_per_s")
    target = Sweep(*((3, 40) if args.smoke else (64, 1024)), device, dtype, args.smoke, copy, not args.eager)
    report["finalists"] = sweep_target(target, args.smoke)
    report["target"] = target.rows
    with open(args.out, "w") as f:  # the target's rows survive a time-out in the other shapes
        json.dump(report, f, indent=1)
    report["shapes"] = sweep_shapes(report["finalists"], device, dtype, args.smoke, copy, not args.eager)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    errors = [r for r in report["target"] + report["shapes"] if "error" in r]
    for r in errors:
        print(f"not timed: B={r['batch']} {r['name']}: {r['error'][:160]}")


if __name__ == "__main__":
    main()
