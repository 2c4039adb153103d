#!/usr/bin/env python3
"""Rimuru against vLLM, side by side: bench records of one device call merged into docs/benchmarks/vs-vllm.json,
and the table of docs/benchmarks/vs-vllm.md written from all of it.

    python -m tools.vs_vllm.table --call 1 --commit abc1234 \\
        vllm=OUT/vllm-stream-400-r10.json resident=OUT/resident-400-r10.json default=OUT/default-400-r10.json

Each `POLICY=RECORD` is a `rimuru bench` record (POLICY: how it was run, `default` for no policy flags) or, for
`vllm`, a `tools/vs_vllm/replay.py` record. A run of the same call, model, budget, stream, engine and policy replaces
the one in the file; the rest stay. The table gives each run's throughput over vLLM's in the same call.
"""

import argparse
import json
import os
import statistics

FIELDS = ("output_tokens_per_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "preemptions", "kv_tokens",
          "peak_concurrency", "requests")  # fmt: skip


def run_of(policy: str, record: dict, call: str) -> dict:
    """One row of vs-vllm.json from a bench or replay record."""
    engine = "vllm" if policy == "vllm" else "rimuru"
    budget = record.get("budget_gib")
    if budget is None:
        budget = _gib(record["engine"]["gpu_memory_budget"])
    run = {"model": os.path.basename(os.path.normpath(record["model"])), "budget_gib": budget,
           "stream": os.path.splitext(os.path.basename(record["stream"]))[0], "engine": engine,
           "policy": "default" if engine == "vllm" else policy, "call": call,
           "output_tokens_per_s": record["output_tokens_per_s"], "ttft_mean_s": record["ttft_s"]["mean"],
           "ttft_p99_s": record["ttft_s"]["p99"], "tpot_mean_s": record["tpot_s"]["mean"],
           "preemptions": record["preemptions"], "kv_tokens": record.get("kv_tokens"),
           "peak_concurrency": record.get("peak_concurrency"), "requests": record["requests"]}  # fmt: skip
    if record.get("rate") is not None:
        run["stream"] += f"@{record['rate']:g}/s"
    if engine == "rimuru":
        run["peak_reserved_gib"] = round(record["peak_reserved_bytes"] / 2**30, 3) if record.get("peak_reserved_bytes") else None
        run["commit"] = record.get("commit")
    else:  # what vLLM's start-up log says it holds (tools/vs_vllm/vllm_memory.py), where the call kept it
        run["peak_reserved_gib"] = (record.get("memory") or {}).get("reserved_gib")
    return run


def _gib(value) -> float:
    if isinstance(value, (int, float)):
        return round(value / 2**30, 3)
    return float(str(value).lower().removesuffix("gib"))


def key(run: dict) -> tuple:
    return run["call"], run["model"], run["budget_gib"], run["stream"], run["engine"], run["policy"]


def merge(document: dict, runs: list[dict]) -> dict:
    fresh = {key(r) for r in runs}
    kept = [r for r in document.get("runs", []) if key(r) not in fresh]
    return document | {"runs": kept + runs}


def table(document: dict) -> str:
    """One table per (model, budget, stream): every run with its ratio to vLLM's run of the same call."""
    groups: dict[tuple, list[dict]] = {}
    for run in document["runs"]:
        groups.setdefault((run["model"], run["budget_gib"], run["stream"]), []).append(run)
    lines = []
    for (model, budget, stream), runs in groups.items():
        vllm = {r["call"]: r["output_tokens_per_s"] for r in runs if r["engine"] == "vllm"}
        lines += [f"### {model}, {budget:g} GiB, {stream}", "",
                  "| call | engine | policy | output tok/s | x vLLM | mean TTFT s | p99 TTFT s | mean TPOT ms | "
                  "preemptions | KV tokens | peak running | reserved GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(runs, key=lambda r: (r["call"], r["engine"] != "vllm", r["policy"])):
            ratio = r["output_tokens_per_s"] / vllm[r["call"]] if r["call"] in vllm else None
            lines.append(f"| {r['call']} | {r['engine']} | {r['policy']} | {r['output_tokens_per_s']:,.0f} | "
                         f"{_fmt(ratio, '.2f')} | {_fmt(r['ttft_mean_s'], '.3f')} | {_fmt(r['ttft_p99_s'], '.3f')} | "
                         f"{_fmt(r['tpot_mean_s'] and r['tpot_mean_s'] * 1e3, '.1f')} | {r['preemptions']} | "
                         f"{_fmt(r['kv_tokens'], ',')} | {_fmt(r['peak_concurrency'], '')} | "
                         f"{_reserved(r.get('peak_reserved_gib'), budget)} |")  # fmt: skip
        ratios = _ratios(runs, vllm)
        if ratios:
            lines += ["", "Over vLLM, median of the calls: " + ", ".join(
                f"{policy} {statistics.median(values):.2f}x ({len(values)})" for policy, values in ratios.items())]
        lines.append("")
    return "\n".join(lines)


def _ratios(runs: list[dict], vllm: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in runs:
        if r["engine"] == "rimuru" and r["call"] in vllm:
            out.setdefault(r["policy"], []).append(r["output_tokens_per_s"] / vllm[r["call"]])
    return out


def _reserved(gib: float | None, budget: float) -> str:
    """The run's peak reserved GiB, marked where it passed the budget."""
    if gib is None:
        return "-"
    return f"{gib:.2f}" + (" (over)" if gib > budget else "")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", metavar="POLICY=RECORD")
    parser.add_argument("--call", required=True, help="names the device call the records came from")
    parser.add_argument("--commit", help="the Rimuru commit measured")
    parser.add_argument("--json", default="docs/benchmarks/vs-vllm.json")
    parser.add_argument("--table", default=None, help="print the table of the JSON to this file (default: stdout)")
    args = parser.parse_args()
    document = json.load(open(args.json)) if os.path.exists(args.json) else {"runs": []}
    runs = []
    for spec in args.records:
        policy, _, path = spec.partition("=")
        with open(path) as f:
            record = json.load(f)
        runs.append(run_of(policy, record, args.call))
        if policy == "vllm":
            document |= {"vllm": record.get("vllm"), "gpu": record.get("device")}
    if runs:
        document = merge(document, runs) | ({"commit": args.commit} if args.commit else {})
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    text = table(document)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
