"""A markdown table from `rimuru bench` records, one row a record, as `docs/benchmarks/paper-scenario.md` prints them.

    python -m tools.reports.table resident=resident.json elastic=elastic.json.gz ...   (the first is the baseline)

Columns: output tok/s and the ratio to the first record, TTFT mean / median / p99, TPOT median, peak / mean
running, forward steps, preemptions, evictions / additions (and swaps), bytes copied and host experts read in place
(each also a step), prefetch hit rate, wall time / routing-hook time / of it the wait for the router / the
adjuster's host time (its round, and the cost rule's `observe` and its estimate refresh, which since 5aa07ff
runs during the pass), per step, and the peak reserved GPU memory.

`--phases` prints instead where the steps' wall time went (records since fc8bf78, `Engine.step_phases`): for each
record and each band of running requests, the mean ms a step of each phase, "outside" the bench's own work between
steps, and the experts on the host.
"""

import argparse

from rimuru.config import parse_bytes
from tools.records import read_records

HEADER = ("| policy | output tok/s | vs first | TTFT mean / median / p99 | TPOT median | peak / mean running "
          "| steps | preemptions | evictions / additions | copied, read in place | prefetch hit rate "
          "| step / hook / router wait / adjuster "
          "| peak reserved |")


# a step's wall time, the routing hook's host time, the part of it waiting for the router, the adjuster's host time
# (records written before the engine counted it lack the last: 0)
STEP_TIMES = ("wall_s", "hook_seconds", "routing_wait_seconds", "adjuster_seconds")


def row(label: str, record: dict, baseline: float) -> str:
    steps, copied, ttft = record["forward_steps"], record["bytes_copied"], record["ttft_s"]
    moved = record["evictions"] or record["additions"]
    changes = f"{record['evictions']} / {record['additions']}" if moved else "-"
    if record.get("swaps"):
        changes += f" (+{record['swaps']} swaps)"
    hit = record["prefetch_hit_rate"]
    cells = [
        label,
        f"{record['output_tokens_per_s']:,.1f}",
        f"{record['output_tokens_per_s'] / baseline:.2f}",
        " / ".join(_g(ttft[k]) for k in ("mean", "median", "p99")) + " s",
        f"{record['tpot_s']['median'] * 1e3:.1f} ms" if record["tpot_s"]["median"] is not None else "-",
        f"{record['peak_concurrency']} / {record['mean_concurrency']:.1f}",
        f"{steps:,}",
        str(record["preemptions"]),
        changes,
        _traffic(copied, record.get("direct_reads"), steps),
        "-" if hit is None else f"{100 * hit:.1f}%",
        " / ".join(f"{1e3 * record.get(k, 0.0) / steps:.2f}" for k in STEP_TIMES) + " ms",
        _reserved(record),
    ]
    if record.get("truncated_at_s") is not None:
        cells[0] += f" (stopped at {record['truncated_at_s']:.0f} s, {record['finished_requests']} finished)"
    return "| " + " | ".join(cells) + " |"


def _traffic(copied: int, direct_reads: int | None, steps: int) -> str:
    """Bytes copied in, and the host experts read in place (direct reads), each also a step."""
    cells = [f"{copied / 1e9:.1f} GB ({copied / steps / 1e6:.1f} MB a step)"] if copied else []
    if direct_reads:
        cells.append(f"{direct_reads:,} host reads ({direct_reads / steps:.1f} a step)")
    return ", ".join(cells) or "0"


def _reserved(record: dict) -> str:
    """The peak reserved GPU memory, flagged where it went past the run's budget (with the peak allocated, the
    tensors' share, where the record has it)."""
    peak = record.get("peak_reserved_bytes")
    if not peak:
        return "-"
    budget = parse_bytes((record.get("engine") or {}).get("gpu_memory_budget"))
    allocated = record.get("peak_allocated_bytes")
    over = f" (over the {budget / 2**30:.2f} GiB budget" if budget and peak > budget else ""
    if over and allocated:
        over += f"; {allocated / 2**30:.2f} GiB allocated"
    return f"{peak / 2**30:.2f} GiB{over}{')' if over else ''}"


def _g(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def table(specs: list[str]) -> str:
    records = read_records(specs)
    baseline = records[0][1]["output_tokens_per_s"]
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    return "\n".join(lines + [row(label, record, baseline) for label, record in records])


PHASES = ("schedule", "adjust", "forward", "expert_changes", "observe")
BANDS = (0, 8, 16, 32, 64)  # requests running after the step: 0-7, 8-15, ..., 64 and more


def phase_table(specs: list[str]) -> str:
    """Mean ms a step by phase, per band of running requests, a row a (record, band)."""
    header = "| policy | running | steps | step | " + " | ".join(PHASES) + " | outside | on the host |"
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for label, record in read_records(specs):
        series = record["series"]
        if not any("forward_ms" in s for s in series):
            raise SystemExit(f"{label}: the record has no step phases (written before fc8bf78)")
        for low, high in zip(BANDS, BANDS[1:] + (None,)):
            steps = [(prev, s) for prev, s in zip(series, series[1:]) if low <= s["running"] < (high or 1 << 30)]
            if not steps:
                continue
            mean = {p: sum(s.get(f"{p}_ms", 0.0) for _, s in steps) / len(steps) for p in PHASES}
            wall = sum(s["t"] - prev["t"] for prev, s in steps) * 1e3 / len(steps)
            host = sum(s["offloaded_experts"] for _, s in steps) / len(steps)
            cells = [label, f"{low}-{high - 1}" if high else f"{low}+", f"{len(steps):,}", f"{wall:.2f}"]
            cells += [f"{mean[p]:.2f}" for p in PHASES] + [f"{wall - sum(mean.values()):.2f}", f"{host:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", metavar="LABEL=RECORD.json")
    parser.add_argument("--phases", action="store_true", help="where the steps' time went, by running requests")
    args = parser.parse_args(argv)
    text = (phase_table if args.phases else table)(args.records)
    print(text)
    return text


if __name__ == "__main__":
    main()
