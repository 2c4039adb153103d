"""Decode attention at the batches of a stream's drain (1 to 64 requests, long contexts): the engine's dispatch against
the unsplit decode kernel and split-KV at each split count and tile, both models' head layouts, one GPU run.

    python -m tools.kernels.small_batch_attention --out small_batch_attention.json      # on a CUDA GPU
    python -m tools.kernels.small_batch_attention --contexts 192 576 --batches 16 --spread-gib 40 --copy-mb 768
    TRITON_INTERPRET=1 python -m tools.kernels.small_batch_attention --smoke            # logic check on CPU

A row is a call's share of a CUDA graph of LAYERS calls, each over a K/V set of its own (as a step's graph calls
attention once a layer; at short contexts the LAYERS sets together still fit in L2). The dispatcher row gets the
page table width the engine's graphs have (TABLE_TOKENS, the longest context a request may reach), which sets its
split count; the other rows tables as long as the context. `--spread-gib` adds the dispatcher and the unsplit kernel
on pages spread over a pool that large, `--copy-mb` both again with a copy that large before every call (the MoE
layer's weight reads before a step's attention), its own time subtracted. Each output is checked against the fp32
reference before it is timed; bytes are K and V of every context token once, and the share is of the
device-to-device copy measured in the same run.
"""

import argparse
import json
import os
import sys

import torch
import triton

from rimuru.ops import reference
from rimuru.ops.decode_attention import decode_attention_triton
from rimuru.ops.paged_attention import attention_config, default_config, paged_attention_triton
from rimuru.ops.split_kv_attention import num_sms, split_kv_attention_triton
from tools.kernels.bench import copy_bandwidth, time_graph_ms, time_ms

HEADS = {"qwen3-30b-a3b": (32, 4, 128), "qwen1.5-moe": (16, 16, 128)}  # Hq, Hk, Dh
TABLE_TOKENS = {"qwen3-30b-a3b": 40960, "qwen1.5-moe": 8192}  # max_position_embeddings: the graphs' table width
BATCHES = [1, 2, 4, 8, 16, 32, 64]
CONTEXTS = [512, 2048]
SPLITS = [2, 4, 8, 16, 32]
TILES = [(64, 4, 2), (64, 4, 3), (128, 8, 2), (128, 4, 2), (32, 4, 3)]  # BLOCK_N, warps, stages
MIN_CHUNKS = [256, 512, 1024]
LAYERS = 8
PAGE_TOKENS = 16


def attention_inputs(heads, batch, context, table_tokens, device, dtype, seed):
    """One layer's decode inputs: `batch` requests of `context` tokens at shuffled 16-token pages, the page table
    `table_tokens` wide (unused columns -1, as the engine's)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_each, width = -(-context // PAGE_TOKENS), -(-max(table_tokens, context) // PAGE_TOKENS)
    num_pages = batch * pages_each + 8
    kv_view = torch.randn(num_pages, 2, PAGE_TOKENS, num_kv_heads, head_dim, device=device, dtype=dtype,
                          generator=gen)  # fmt: skip
    table = torch.full((batch, width), -1, dtype=torch.int32, device=device)
    table[:, :pages_each] = torch.randperm(num_pages, device=device, generator=gen)[: batch * pages_each].view(
        batch, pages_each).to(torch.int32)  # fmt: skip
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, device=device, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    return query, kv_view, table, seq_lens, query_start_loc, head_dim**-0.5


def spread_sets(sets, spread_gib, table_tokens, seed):
    """The same inputs with their pages moved to random places of one pool of `spread_gib` GiB (as the engine's K/V
    pages lie among the experts' across its whole pool), tables `table_tokens` wide: what the page walk costs."""
    kv_view = sets[0][1]
    page_bytes = kv_view[0].numel() * kv_view.element_size()
    pool = torch.empty(int(spread_gib * 2**30) // page_bytes, *kv_view.shape[1:], dtype=kv_view.dtype,
                       device=kv_view.device)  # fmt: skip
    gen = torch.Generator(device=kv_view.device).manual_seed(seed)
    places = torch.randperm(pool.shape[0], device=kv_view.device, generator=gen)
    spread, width = [], -(-table_tokens // PAGE_TOKENS)
    for i, (query, kv, table, seq_lens, query_start_loc, scale) in enumerate(sets):
        ids = places[i * kv.shape[0] : (i + 1) * kv.shape[0]]
        pool[ids] = kv
        moved = torch.full((table.shape[0], max(width, table.shape[1])), -1, dtype=torch.int32, device=kv.device)
        moved[:, : table.shape[1]] = torch.where(table >= 0, ids[table.clamp(min=0).long()].to(torch.int32), -1)
        spread.append((query, pool, moved, seq_lens, query_start_loc, scale))
    return spread


def kv_bytes(heads, batch, context) -> int:
    _, num_kv_heads, head_dim = heads
    return 2 * batch * context * num_kv_heads * head_dim * 2


def split_config(group, tile, splits, min_chunk=0) -> dict:
    block_n, warps, stages = tile
    return {"BLOCK_Q": max(1, 16 // triton.next_power_of_2(group)), "BLOCK_N": block_n, "num_warps": warps,
            "num_stages": stages, "NUM_SPLITS": splits, "PREFETCH_PAGES": True, "MIN_CHUNK": min_chunk}  # fmt: skip


def variants(heads, batch, context, sms, smoke):
    """(name, launcher(args) -> out) for the rows of one shape."""
    num_heads, num_kv_heads, _ = heads
    group = num_heads // num_kv_heads
    decode = attention_config(batch, batch, group)["DECODE"]
    rows = [("dispatcher", lambda a: paged_attention_triton(*a)),
            ("decode kernel, unsplit", lambda a: decode_attention_triton(*a[:4], a[5], decode)[0])]  # fmt: skip
    for min_chunk in MIN_CHUNKS:  # the dispatcher's split count, no split shorter than min_chunk tokens
        rows.append((f"dispatcher, min chunk {min_chunk}", lambda a, mc=min_chunk: paged_attention_triton(
            *a, config=default_config(*a[:3], batch) | {"MIN_CHUNK": mc})))  # fmt: skip
    tiles, long_tiles = ([(16, 4, 2)], []) if smoke else (TILES, [(64, 4, 3), (128, 8, 2)])
    for splits in [2] if smoke else SPLITS:
        if not smoke and (splits * 128 > 2 * context or batch * num_kv_heads * splits > 16 * sms):
            continue  # splits of under 64 tokens, or far more programs than the GPU runs at once
        configs = [(f"tile {t}", split_config(group, t, splits)) for t in tiles]
        configs += [(f"min chunk {m}, tile {t}", split_config(group, t, splits, m)) for m in MIN_CHUNKS[:2]
                    for t in long_tiles]  # fmt: skip
        rows += [(f"split {splits}, {label}", lambda a, cfg=cfg: split_kv_attention_triton(*a, cfg))
                 for label, cfg in configs]  # fmt: skip
    return rows


def with_copies_between(named, copy_mb, device):
    """The rows again, each call after a copy of `copy_mb` MB (as a step's attention follows its MoE layer's weight
    reads: L2, TLBs and clocks as they leave them), and the copies alone, to subtract."""
    src = torch.empty(copy_mb << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows = [(f"{name}, after {copy_mb} MB copies", lambda a, f=launch: (dst.copy_(src), f(a))[1])
            for name, launch in named]  # fmt: skip
    return rows + [(f"{copy_mb} MB copies alone", lambda a: dst.copy_(src))]


def measure_shape(model, batch, context, table_tokens, device, dtype, smoke, copy_tb_per_s, spread_gib=0,
                  copy_mb=0):  # fmt: skip
    heads = HEADS[model]
    layers = 1 if smoke else LAYERS
    narrow = [attention_inputs(heads, batch, context, context, device, dtype, i) for i in range(layers)]
    wide = [attention_inputs(heads, batch, context, table_tokens, device, dtype, i) for i in range(layers)]
    spread = spread_sets(narrow, spread_gib, table_tokens, 0) if spread_gib else []
    ref = reference.paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                      for a in narrow[0]])  # fmt: skip
    rows = []
    named = variants(heads, batch, context, num_sms(torch.device(device)), smoke)
    extra = [(f"{name}, pages spread over {spread_gib:g} GiB", launch) for name, launch in named[:2]] if spread else []
    extra += with_copies_between(named[:2], copy_mb, device) if copy_mb else []
    for name, launch in extra + named:
        sets = spread if "spread" in name else wide if name.startswith("dispatcher") else narrow
        row = {"model": model, "batch": batch, "context": context, "name": name}
        try:
            out = launch(sets[0])
        except Exception as error:  # a tile that does not fit is a row, not a crash
            rows.append(row | {"error": str(error)[:200]})
            continue
        row["rel_err"] = 0.0 if "alone" in name else ((out.float() - ref).norm() / ref.norm()).item()
        if not row["rel_err"] < 1e-2:
            rows.append(row | {"error": "output differs from the reference"})
            continue
        run = lambda: [launch(a) for a in sets]  # noqa: E731
        row["us"] = 1e3 * (time_ms(run, smoke) if smoke else time_graph_ms(run)) / layers
        row["tb_per_s"] = kv_bytes(heads, batch, context) / row["us"] / 1e6
        if copy_tb_per_s:
            row["of_copy"] = row["tb_per_s"] / copy_tb_per_s
        rows.append(row)
    alone = [r["us"] for r in rows if "alone" in r["name"] and "us" in r]
    for r in rows:
        if alone and "after" in r["name"] and "us" in r:
            r["us_with_copies"], r["us"] = r["us"], r["us"] - alone[0]  # the attention's share after the copies
            r["tb_per_s"] = kv_bytes(heads, batch, context) / r["us"] / 1e6
    timed = sorted((r for r in rows if "us" in r and "alone" not in r["name"]), key=lambda r: r["us"])
    dispatcher = [r for r in timed if r["name"] == "dispatcher"]
    spread_rows = [r for r in timed if "spread" in r["name"] or "after" in r["name"]]
    others = [r for r in timed if r["name"] != "dispatcher" and r not in spread_rows]
    for r in dispatcher + spread_rows + others[:3]:  # the engine's, then the fastest
        share = f" {100 * r['of_copy']:.0f}%" if "of_copy" in r else ""
        print(f"{model} B={batch} ctx={context} {r['name']}: {r['us']:.1f} us {r['tb_per_s']:.2f} TB/s{share}",
              flush=True)  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="small_batch_attention.json")
    parser.add_argument("--smoke", action="store_true", help="CPU logic check under TRITON_INTERPRET=1")
    parser.add_argument("--models", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--spread-gib", type=float, default=0,
                        help="also the dispatcher and the unsplit kernel on pages spread over a pool this large")
    parser.add_argument("--copy-mb", type=int, default=0,
                        help="also the dispatcher and the unsplit kernel each after a copy this large")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    report = {"argv": sys.argv, "torch": torch.__version__, "commit": os.environ.get("RIMURU_COMMIT", "unknown")}
    if not args.smoke:
        report |= {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_tb_per_s": copy_bandwidth()}
        print(f"device-to-device copy: {report['copy_tb_per_s']:.2f} TB/s", flush=True)
    shapes = [(m, 2, 40) for m in args.models] if args.smoke else [
        (m, b, c) for m in args.models for c in args.contexts for b in args.batches]  # fmt: skip
    report["rows"] = []
    for model, batch, context in shapes:
        table_tokens = 64 if args.smoke else TABLE_TOKENS[model]
        report["rows"] += measure_shape(model, batch, context, table_tokens, device, dtype, args.smoke,
                                        report.get("copy_tb_per_s"), args.spread_gib, args.copy_mb)  # fmt: skip
        if not args.smoke:
            torch.cuda.empty_cache()  # the spread pool and copy buffers of one shape, before the next allocates its own
        with open(args.out, "w") as f:  # rows so far survive a time-out
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
