"""Benchmark Rimuru's paged MoE and paged attention kernels; writes a JSON report and prints a table.

    python -m tools.kernels.bench --out kernels.json            # on a CUDA GPU
    TRITON_INTERPRET=1 python -m tools.kernels.bench --smoke    # logic check on CPU, tiny shapes, times meaningless
    python -m tools.kernels.bench --breakdown --out breakdown.json   # the MoE op piece by piece (breakdown.py)

MoE, per model shape and M = 1, 2, 4, ..., 4096 tokens (bf16, softmax top-k routing of random logits):
  paged     both GEMM kernels, experts at shuffled pages of a pool 1.5x the experts' size (sorting excluded)
  identity  the same kernels and tiles, expert e at pages 3e, 3e+1, 3e+2 of a contiguous view
  op        the whole rimuru::paged_moe call: sorting, both GEMMs, top-k sum (eager launches)
  op_graph  the same call replayed from a CUDA graph (launch gaps removed)
  vllm      vLLM 0.33.0 fused MoE GEMMs + activation, copied from shared/ANCHORS.md (NOT measured here)
  roofline  max(bytes of the experts touched / 4.2 TB/s, FLOPs / 764 TFLOP/s), ceilings from ANCHORS.md
Attention: decode, batch 64, 1024-token contexts, Hq=32, Hk=4, Dh=128, 16-token pages in shuffled order; achieved
bandwidth = K/V bytes read (+ queries, outputs) / time, and its share of the device-to-device copy measured in the same
run. The dispatcher's default, 18 unsplit tiles and 32 split-KV ones (2 to 16 splits) are timed; then the default
against the unsplit kernel at other batch sizes and context lengths (checks the split-count heuristic).
Top-k sum: the whole op's torch reduction over [T, K, D] bf16 at M = 64, 1024, 4096, as achieved bandwidth.
Times are medians of CUDA-event timings after warm-up (triton.testing.do_bench, L2 flushed before each run).
"""

import argparse
import functools
import json
import os
import sys
import time

import torch

from rimuru.ops import reference
from rimuru.ops.configs import moe_config
from rimuru.ops.moe_align import align_tokens, align_tokens_torch, align_tokens_triton
from rimuru.ops.paged_attention import default_config, paged_attention_triton
from rimuru.ops.paged_moe import moe_gemms, paged_moe_triton

MODELS = {
    "qwen3-30b-a3b": {"E": 128, "F": 768, "D": 2048, "K": 8},
    "qwen1.5-moe": {"E": 60, "F": 1408, "D": 2048, "K": 4},
}
# ANCHORS.md, "The MoE kernel": vLLM 0.33.0 fused MoE on the project's H200, GEMMs + activation, sorting excluded.
VLLM_GEMM_ONLY_MS = {
    "qwen3-30b-a3b": {1: 0.130, 8: 0.144, 64: 0.302, 256: 0.329, 1024: 0.384, 4096: 0.822},
    "qwen1.5-moe": {1: 0.158, 8: 0.158, 64: 0.268, 256: 0.284, 1024: 0.332, 4096: 0.836},
}
COPY_BYTES_PER_S = 4.2e12  # ANCHORS.md: device-to-device copy, read + write
GEMM_FLOPS_PER_S = 764e12  # ANCHORS.md: bf16 GEMM 8192^3
M_VALUES = [2**i for i in range(13)]


def time_ms(fn, smoke=False, warmup=10, rep=40):
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_graph_ms(fn, calls: int = 1):
    """Median ms of `fn` as a CUDA graph replay: a graph of `calls` back-to-back calls, its time over `calls` (more
    than one: what a kernel costs inside a step's graph, without the replay's own launch in every figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay) / calls


def expert_pools(shape, device, dtype, seed=0):
    """(paged view, paged table, identity view, identity table) holding the same weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_experts, page = shape["E"], shape["F"] * shape["D"]
    num_pages = 3 * num_experts * 3 // 2
    pool = torch.randn(num_pages, page, device=device, dtype=dtype, generator=gen) * 0.02
    table = torch.randperm(num_pages, device=device, generator=gen)[: 3 * num_experts]
    table = table.view(num_experts, 3).to(torch.int32)
    identity = pool[table.flatten().long()]  # [3E, F * D], expert e at pages 3e..3e+2
    identity_table = torch.arange(3 * num_experts, device=device, dtype=torch.int32).view(num_experts, 3)
    return pool, table, identity, identity_table


def routing(num_tokens, shape, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num_tokens, shape["E"], device=device, generator=gen)
    weights, ids = logits.softmax(-1).topk(shape["K"], dim=-1)
    return ids, weights


def roofline_ms(num_tokens, ids, shape):
    touched = torch.unique(ids).numel()
    weight_bytes = touched * 3 * shape["F"] * shape["D"] * 2
    flops = 2 * num_tokens * shape["K"] * 3 * shape["F"] * shape["D"]
    return max(weight_bytes / COPY_BYTES_PER_S, flops / GEMM_FLOPS_PER_S) * 1e3


def bench_moe_point(name, shape, num_tokens, pools, device, dtype, smoke):
    pool, table, identity, identity_table = pools
    ids, weights = routing(num_tokens, shape, device, seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device=device, dtype=dtype)
    cfg = moe_config(num_tokens, shape["E"], shape["F"], shape["D"], shape["K"], device)
    aligned = align_tokens(ids, shape["E"], cfg["BLOCK_M"])

    def gemms(view, pages):
        return lambda: moe_gemms(hidden, view, pages, weights, *aligned, shape["F"], cfg)

    row = {"model": name, "M": num_tokens, "config": cfg}
    row["paged_ms"] = time_ms(gemms(pool, table), smoke)
    row["identity_ms"] = time_ms(gemms(identity, identity_table), smoke)
    if not smoke:  # the same comparison without the host's launch time, which bounds the eager one at small M
        row["paged_graph_ms"] = time_graph_ms(gemms(pool, table))
        row["identity_graph_ms"] = time_graph_ms(gemms(identity, identity_table))
        row["paged_vs_identity_graph_pct"] = 100 * (row["paged_graph_ms"] / row["identity_graph_ms"] - 1)
    whole = lambda: paged_moe_triton(hidden, pool, table, ids, weights, shape["F"])  # noqa: E731
    row["op_ms"] = time_ms(whole, smoke)
    row["op_graph_ms"] = None if smoke else time_graph_ms(whole)
    row["align_torch_ms"] = time_ms(lambda: align_tokens_torch(ids, shape["E"], cfg["BLOCK_M"]), smoke)
    if ids.numel() <= 4096:
        row["align_triton_ms"] = time_ms(lambda: align_tokens_triton(ids, shape["E"], cfg["BLOCK_M"]), smoke)
    row["vllm_gemm_only_ms"] = VLLM_GEMM_ONLY_MS[name].get(num_tokens)
    row["roofline_ms"] = roofline_ms(num_tokens, ids, shape)
    row["paged_vs_identity_pct"] = 100 * (row["paged_ms"] / row["identity_ms"] - 1)
    row["paged_minus_identity_us"] = 1e3 * (row["paged_ms"] - row["identity_ms"])
    row["roofline_fraction"] = row["roofline_ms"] / row["paged_ms"]
    if num_tokens in (1, 64, 1024):
        args = (hidden, pool, table, ids, weights, shape["F"])
        ref = reference.paged_moe(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
        tri = whole().float()
        row["rel_err_vs_fp32_ref"] = ((tri - ref).norm() / ref.norm()).item()
        row["paged_equals_identity"] = bool(torch.equal(gemms(pool, table)(), gemms(identity, identity_table)()))
    return row


def decode_inputs(batch, context, device, dtype, smoke):
    """A decode step: `batch` requests of `context` tokens (this step's included), 16-token pages in shuffled order."""
    num_heads, num_kv_heads, head_dim, page_tokens = (8, 2, 32, 4) if smoke else (32, 4, 128, 16)
    pages_each = -(-context // page_tokens)
    num_pages = batch * pages_each + 64
    kv_view = torch.randn(num_pages, 2, page_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    page_table = torch.randperm(num_pages, device=device)[: batch * pages_each].view(batch, pages_each)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, device=device, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
    moved = 2 * batch * context * num_kv_heads * head_dim * 2 + 2 * query.numel() * 2  # K, V, queries, outputs
    return (query, kv_view, page_table.to(torch.int32), seq_lens, query_start_loc, head_dim**-0.5), moved


def time_attention(args, moved, cfg, smoke, copy_tb_per_s):
    try:
        ms = time_ms(lambda: paged_attention_triton(*args, config=cfg), smoke)
    except Exception as error:  # a tile that does not fit (shared memory) is skipped, not fatal
        return {"config": cfg, "error": str(error)[:200]}
    row = {"config": cfg or "default", "ms": ms, "bytes": moved, "tb_per_s": moved / ms / 1e9}
    return row | ({"of_copy": row["tb_per_s"] / copy_tb_per_s} if copy_tb_per_s else {})


def decode_configs(group, smoke):
    """The dispatcher's default, then unsplit and split-KV tiles."""
    tiles = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    unsplit = [{"BLOCK_Q": max(1, 16 // group), "BLOCK_N": n, "num_warps": w, "num_stages": s, "NUM_SPLITS": 1}
               for n, w, s in tiles]
    split = [{"BLOCK_Q": max(1, 16 // group), "BLOCK_N": n, "num_warps": w, "num_stages": s, "NUM_SPLITS": k}
             for k in (2, 4, 8, 16) for n in (64, 128) for w in (4, 8) for s in (2, 3)]
    return [None] + (unsplit[:1] + split[:2] if smoke else unsplit + split)


def bench_attention(device, dtype, smoke, copy_tb_per_s=None):
    """Sweep at the target shape (B 64, 1024 tokens), then the default vs the best unsplit tile at other shapes."""
    batch, context = (3, 40) if smoke else (64, 1024)
    args, moved = decode_inputs(batch, context, device, dtype, smoke)
    group = args[0].shape[1] // args[1].shape[3]
    rows = [time_attention(args, moved, cfg, smoke, copy_tb_per_s) for cfg in decode_configs(group, smoke)]
    ref = reference.paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    tri = paged_attention_triton(*args).float()
    report = {"batch": batch, "context": context, "Hq": args[0].shape[1], "Hk": args[1].shape[3],
              "Dh": args[0].shape[2], "page_tokens": args[1].shape[2],
              "default_config": default_config(*args[:3], batch),
              "rel_err_vs_fp32_ref": ((tri - ref).norm() / ref.norm()).item(), "configs": rows, "shapes": []}
    unsplit = {"BLOCK_Q": max(1, 16 // group), "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "NUM_SPLITS": 1}
    for batch, context in ([(2, 40)] if smoke else [(1, 8192), (8, 4096), (16, 2048), (32, 1024), (64, 4096),
                                                     (128, 1024), (256, 512)]):
        args, moved = decode_inputs(batch, context, device, dtype, smoke)
        report["shapes"].append({"batch": batch, "context": context, "default_config": default_config(*args[:3], batch),
                                 "default": time_attention(args, moved, None, smoke, copy_tb_per_s),
                                 "unsplit": time_attention(args, moved, unsplit, smoke, copy_tb_per_s)})
    return report


def bench_topk_sum(device, dtype, smoke, copy_tb_per_s=None):
    """The whole op's top-k sum (torch, fp32 accumulation, bf16 out) over [T, K, D]: achieved bandwidth."""
    rows = []
    for name, shape in ({"tiny": {"K": 2, "D": 72}} if smoke else MODELS).items():
        for num_tokens in (M_VALUES[:2] if smoke else (64, 1024, 4096)):
            pairs = torch.randn(num_tokens * shape["K"], shape["D"], device=device, dtype=dtype)  # [T * K, D]
            ms = time_ms(functools.partial(torch.sum, pairs.view(num_tokens, shape["K"], shape["D"]), 1), smoke)
            moved = pairs.numel() * pairs.element_size() * (1 + 1 / shape["K"])  # read [T, K, D], write [T, D]
            row = {"model": name, "M": num_tokens, "ms": ms, "bytes": moved, "tb_per_s": moved / ms / 1e9}
            rows.append(row | ({"of_copy": row["tb_per_s"] / copy_tb_per_s} if copy_tb_per_s else {}))
    return rows


def copy_bandwidth():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e9  # bytes / ms / 1e9 = TB/s


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1")
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--skip-attention", action="store_true", help="the MoE points only")
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES,
                        help="the MoE points, timed in the order given (default 1, 2, 4, ..., 4096)")
    parser.add_argument("--breakdown", action="store_true", help="only the MoE op piece by piece (about a minute)")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    report = {"argv": sys.argv, "torch": torch.__version__}
    if not args.smoke:
        import triton

        report |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "commit": os.environ.get("RIMURU_COMMIT", "unknown"), "copy_tb_per_s": copy_bandwidth()}
    copy = report.get("copy_tb_per_s")
    if args.breakdown:
        return write_breakdown(report, args.out, device, dtype, args.smoke, copy)
    if not args.skip_attention:
        report["attention_decode"] = bench_attention(device, dtype, args.smoke, copy)
        report["topk_sum"] = bench_topk_sum(device, dtype, args.smoke, copy)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print_attention(report["attention_decode"], report["topk_sum"])
    report["moe"] = []
    models = {"tiny": {"E": 6, "F": 40, "D": 72, "K": 2}} if args.smoke else MODELS
    for name, shape in ([] if args.skip_moe else models.items()):
        VLLM_GEMM_ONLY_MS.setdefault(name, {})
        pools = expert_pools(shape, device, dtype)
        for m in (args.m[:3] if args.smoke else args.m):
            started = time.time()  # to match a clock log (`device_session.sh anchors`): large M heats the GPU
            report["moe"].append(bench_moe_point(name, shape, m, pools, device, dtype, args.smoke))
            report["moe"][-1]["started_unix_s"] = started
            with open(args.out, "w") as f:  # partial results survive a time-out
                json.dump(report, f, indent=1)
        del pools
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_moe(report["moe"])


def write_breakdown(report, path, device, dtype, smoke, copy_tb_per_s):
    from tools.kernels.breakdown import run_breakdown

    if copy_tb_per_s:
        print(f"device-to-device copy: {copy_tb_per_s:.2f} TB/s")
    report["breakdown"] = run_breakdown(device, dtype, smoke, copy_tb_per_s)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def attention_line(row):
    share = f" ({100 * row['of_copy']:.0f}% of copy)" if "of_copy" in row else ""
    return f"{row['ms'] * 1e3:.1f} us, {row['tb_per_s']:.2f} TB/s{share}" if "ms" in row else row["error"][:80]


def print_attention(att, topk_sum):
    print(f"attention decode B={att['batch']} ctx={att['context']} rel_err={att['rel_err_vs_fp32_ref']:.2e}"
          f" default={att['default_config']}")
    for row in att["configs"]:
        print(f"  {row['config']}: {attention_line(row)}")
    timed = [row for row in att["configs"] if "ms" in row]
    for splits in sorted({row["config"]["NUM_SPLITS"] for row in timed if row["config"] != "default"}):
        best = min((r for r in timed if r["config"] != "default" and r["config"]["NUM_SPLITS"] == splits),
                   key=lambda r: r["ms"])
        print(f"best with {splits} split(s): {best['config']}: {attention_line(best)}")
    for shape in att["shapes"]:
        print(f"B={shape['batch']} ctx={shape['context']} splits={shape['default_config']['NUM_SPLITS']}:"
              f" default {attention_line(shape['default'])} | unsplit {attention_line(shape['unsplit'])}")
    for row in topk_sum:
        print(f"top-k sum {row['model']} M={row['M']}: {attention_line(row)}")


def print_moe(rows):
    print("model M | paged identity diff% | graphs: paged identity diff% | op op_graph vllm roofline | roofline% | err")
    for r in rows:
        vllm = f"{r['vllm_gemm_only_ms']:.3f}" if r["vllm_gemm_only_ms"] else "-"
        graph = f"{r['op_graph_ms']:.4f}" if r["op_graph_ms"] else "-"
        gemm_graphs = (f"{r['paged_graph_ms']:.4f} {r['identity_graph_ms']:.4f} {r['paged_vs_identity_graph_pct']:+.2f}"
                       if "paged_graph_ms" in r else "-")
        print(f"{r['model']} {r['M']} | {r['paged_ms']:.4f} {r['identity_ms']:.4f} {r['paged_vs_identity_pct']:+.2f} |"
              f" {gemm_graphs} | {r['op_ms']:.4f} {graph} {vllm} {r['roofline_ms']:.4f} | {100 * r['roofline_fraction']:.0f}% |"
              f" {r.get('rel_err_vs_fp32_ref', '')}")


if __name__ == "__main__":
    main()
