#!/usr/bin/env python3
"""One decoder layer of vLLM's and of Rimuru's decode step, kernel by kernel, from the torch-profiler traces that
`stepvs` with STEP_PROFILE=1 writes (`vllm-decode-steps-trace-B.json.gz`, `rimuru-decode-trace-B.json.gz`).

    python tools/vs_vllm/trace_layers.py RIMURU_TRACE VLLM_TRACE [--steps-vllm 10 --steps-rimuru 20]

Prints each engine's kernels with their median time a call and calls a step, then three spans a layer (medians):
start to start of the layer's KV write, the attention from its first kernel's start to its merge's end, and the MoE
from its sort's start to its sum's end. Under programmatic dependent launch a kernel's time includes its wait for the
one before it, so the spans are what to compare, not the MoE kernels' own times.
"""

import argparse
import collections
import gzip
import json
import statistics

# per engine: (KV write, attention's first kernel, its merge, MoE sort, MoE sum) name prefixes
MARKERS = {
    "rimuru": ("_rope_write_kv", "_split_kv", "_combine", "_align", "_topk_sum"),
    "vllm": ("void vllm::reshape_and_cache", "void cutlass::device_kernel<flash::enable",
             "void cutlass::device_kernel<flash::FlashAttnFwdCombine", "void vllm::moe::moe_align",
             "void vllm::moe::moe_sum"),
}  # fmt: skip


def kernels(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def spans(events: list[dict], markers: tuple[str, ...]) -> dict[str, float]:
    def named(prefix):
        return [e for e in events if e["name"].startswith(prefix)]

    write, attn_first, attn_last, moe_first, moe_last = (named(m) for m in markers)
    period = [b["ts"] - a["ts"] for a, b in zip(write, write[1:]) if b["ts"] - a["ts"] < 2000]  # within a step
    attention = [c["ts"] + c["dur"] - a["ts"] for a, c in zip(attn_first, attn_last)]
    moe = [s["ts"] + s["dur"] - a["ts"] for a, s in zip(moe_first, moe_last)]
    return {"layer": statistics.median(period), "attention": statistics.median(attention),
            "moe": statistics.median(moe)}  # fmt: skip


def table(events: list[dict], steps: int, rows: int = 24) -> list[str]:
    times = collections.defaultdict(list)
    for e in events:
        times[e["name"]].append(e["dur"])
    ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:rows]
    return [f"  {statistics.median(t):8.1f} us x {len(t) / steps:6.1f} a step  {name[:100]}" for name, t in ranked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rimuru")
    parser.add_argument("vllm")
    parser.add_argument("--steps-rimuru", type=int, default=20, help="decode steps the Rimuru trace holds")
    parser.add_argument("--steps-vllm", type=int, default=10, help="decode steps the vLLM trace holds")
    args = parser.parse_args()
    for engine, path, steps in (("rimuru", args.rimuru, args.steps_rimuru), ("vllm", args.vllm, args.steps_vllm)):
        events = kernels(path)
        print(f"{engine}: {len(events) / steps:.0f} kernels a step")
        print("\n".join(table(events, steps)))
        print("  a layer (us, medians): " + ", ".join(f"{k} {v:.1f}" for k, v in spans(events, MARKERS[engine]).items()))


if __name__ == "__main__":
    main()
