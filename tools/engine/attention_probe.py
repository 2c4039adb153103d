"""Decode attention on the engine's own inputs: what makes the split-KV kernel slower inside a step than alone.

Runs `--num-requests` requests of a stream into decode (eagerly, as `profile_step` fills them), records every
layer's `paged_attention` arguments of one decode step, then times them as CUDA graphs of one call a layer, each
row's output checked against the recorded call's:

    engine        the calls as the eager step made them (tables as wide as the batch's longest request)
    graph width   tables as wide as the engine's graphs hold them (max_model_len): the split count the graphs get
    compact       the same K/V copied to fresh pages in request order, tables remapped: the pool's layout aside
    after copies  `graph width` with a copy of `--copy-mb` MB before each call (a MoE layer's weight reads: L2,
                  TLBs and clocks as they leave them), the copies' own time subtracted; then the same at each of
                  `--splits` split counts (more programs to hide each tile's latency there)

    python -P -m tools.engine.attention_probe MODEL --load-format dummy --stream s.jsonl --num-requests 16 \
        --expert-policy resident --gpu-memory-budget 64GiB --out probe.json
"""

import argparse
import json

import torch

import rimuru.ops as ops
from rimuru.benchmark import read_stream
from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.ops.paged_attention import attention_config, paged_attention_triton
from rimuru.serving.cli import add_engine_arguments, engine_options
from tools.engine.profile_step import add_fill_arguments, fill
from tools.kernels.bench import time_graph_ms


def recorded_attention_calls(engine: Engine) -> list[tuple]:
    """Each layer's (query, kv_view, page_table, seq_lens, query_start_loc, scale) of one eager decode step."""
    calls, original = [], ops.paged_attention

    def recording(query, kv_view, page_table, seq_lens, query_start_loc, scale):
        calls.append((query.clone(), kv_view, page_table.clone(), seq_lens.clone(), query_start_loc.clone(), scale))
        return original(query, kv_view, page_table, seq_lens, query_start_loc, scale)

    ops.paged_attention = recording
    try:
        engine.step()
    finally:
        ops.paged_attention = original
    return calls


def widened(call: tuple, width: int) -> tuple:
    query, kv_view, table, *rest = call
    wide = torch.full((table.shape[0], width), -1, dtype=table.dtype, device=table.device)
    wide[:, : table.shape[1]] = table
    return (query, kv_view, wide, *rest)


def compacted(call: tuple) -> tuple:
    """The call's K/V pages copied, in table order, into a tensor of their own; the table renumbered to match."""
    query, kv_view, table, seq_lens, query_start_loc, scale = call
    used = table >= 0
    pages = kv_view[table[used].long()].clone()  # [N, 2, S, Hk, Dh]
    renumbered = torch.full_like(table, -1)
    renumbered[used] = torch.arange(int(used.sum()), dtype=table.dtype, device=table.device)
    return (query, pages, renumbered, seq_lens, query_start_loc, scale)


def check_rows(rows: dict[str, list[tuple]]) -> None:
    """Every row's outputs equal the engine's calls' (to the rounding a different split count may bring)."""
    expected = [ops.paged_attention(*call) for call in rows["engine"]]
    for row_calls in rows.values():
        for call, want in zip(row_calls, expected):
            torch.testing.assert_close(ops.paged_attention(*call), want, rtol=1e-2, atol=1e-2)


def split_attention(num_splits: int):
    """The attention op with its split count forced (the rest of the dispatcher's config kept)."""

    def attend(query, kv_view, table, seq_lens, query_start_loc, scale):
        group = query.shape[1] // kv_view.shape[3]
        cfg = attention_config(query.shape[0], seq_lens.shape[0], group, num_splits, query.element_size())
        return paged_attention_triton(query, kv_view, table, seq_lens, query_start_loc, scale, cfg)

    return attend


def time_us(calls: list[tuple], before=None, attend=None) -> float:
    attend = attend or ops.paged_attention

    def run():
        for call in calls:
            if before is not None:
                before()
            attend(*call)

    return 1e3 * time_graph_ms(run) / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_fill_arguments(parser, num_requests=16, max_tokens=1024)
    parser.add_argument("--copy-mb", type=int, default=768, help="the copy before each call of the last row")
    parser.add_argument("--splits", type=int, nargs="*", default=[4, 8, 16], help="split counts of the last rows")
    parser.add_argument("--out", default="attention_probe.json")
    add_engine_arguments(parser)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, **(engine_options(args) | {"cuda_graphs": False})))
    fill(engine, read_stream(args.stream, args.num_requests), args.max_tokens)
    engine.step()  # warm-up: every request decoding
    calls = recorded_attention_calls(engine)
    width = -(-engine.config.max_model_len // engine.kv_cache.page_tokens)
    rows = {"engine": calls, "graph width": [widened(c, width) for c in calls],
            "compact": [compacted(c) for c in calls]}  # fmt: skip
    check_rows(rows)
    report = {"model": args.model, "num_requests": args.num_requests, "layers": len(calls),
              "seq_lens": calls[0][3].tolist(), "rows": {}}  # fmt: skip
    if not torch.cuda.is_available():
        print(f"no GPU: {len(calls)} layers' calls recorded and every row's outputs checked, nothing timed")
        return
    for name, row_calls in rows.items():
        report["rows"][name] = time_us(row_calls)
    src = torch.empty(args.copy_mb << 20, dtype=torch.uint8, device=calls[0][0].device)
    dst = torch.empty_like(src)
    copies = 1e3 * time_graph_ms(lambda: [dst.copy_(src) for _ in calls]) / len(calls)
    after = time_us(rows["graph width"], lambda: dst.copy_(src))
    report["rows"][f"graph width, after {args.copy_mb} MB copies"] = after - copies
    expected = [ops.paged_attention(*call) for call in calls]
    for splits in args.splits:
        attend = split_attention(splits)
        for call, want in zip(rows["graph width"], expected):
            torch.testing.assert_close(attend(*call), want, rtol=1e-2, atol=1e-2)
        after = time_us(rows["graph width"], lambda: dst.copy_(src), attend)
        report["rows"][f"graph width, after {args.copy_mb} MB copies, {splits} splits"] = after - copies
    report["copies_us"] = copies
    for name, us in report["rows"].items():
        print(f"attention, {args.num_requests} requests, {name}: {us:.1f} us a call", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
