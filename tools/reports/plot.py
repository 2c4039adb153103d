"""PNG plots from `rimuru bench` records: concurrency over time, the pool split over time, the prefetch hit rate
and the host experts routed a step over time, the cost rule's view over time (records whose samples carry it), and
throughput / TTFT against request rate, one line per label.

    python -m tools.reports.plot OUT_DIR resident=r5.json elastic=e5.json ...   (a label may repeat across rates)
"""

import argparse
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tools.records import read_records  # noqa: E402


def plot_concurrency(records, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, record in records:
        series = record["series"]
        ax.plot([s["t"] for s in series], [s["running"] for s in series], label=f"{label} (rate {record.get('rate')})")
    ax.set(xlabel="seconds", ylabel="running requests", title="Concurrency over time")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "concurrency.png")


def plot_pool_split(records, out_dir: str) -> list[str]:
    """Expert pages, KV pages and trapped KV pages (in expert-page equivalents) and free expert pages over time."""
    paths = []
    for index, (label, record) in enumerate(records):
        series = record["series"]
        kv_per_expert = record.get("kv_pages_per_expert_page") or 1
        t = [s["t"] for s in series]
        layers = [[s["expert_pages"] for s in series], [s["kv_pages"] / kv_per_expert for s in series],
                  [s["trapped_kv_pages"] / kv_per_expert for s in series], [s["free_expert_pages"] for s in series]]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.stackplot(t, layers, labels=["experts", "KV", "free KV pages (trapped)", "free"], alpha=0.8)
        ax.set(xlabel="seconds", ylabel="expert pages", title=f"Pool split: {label} (rate {record.get('rate')})")
        ax.legend(loc="lower right", fontsize=7)
        paths.append(_save(fig, out_dir, f"pool-{index}-{label}.png"))
    return paths


def _prefetch_windows(record, count: int = 50):
    """(end time, hits, misses, direct reads, forward steps) in `count` windows of a run's series (records with host
    experts; older records lack the counters, and before 480ab55 the direct reads). Thinned series
    (`series_stride`) count their stride of steps an entry."""
    series = [s for s in record["series"] if "prefetch_hits" in s]
    width, stride = max(1, len(series) // count), record.get("series_stride", 1)
    for start, end in zip(series[::width], series[width::width]):
        hits, misses = (end[k] - start[k] for k in ("prefetch_hits", "prefetch_misses"))
        yield end["t"], hits, misses, end.get("direct_reads", 0) - start.get("direct_reads", 0), width * stride


def plot_hit_rate(records, out_dir: str) -> str:
    """Prefetch hit rate in windows of 1/50 of each run."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, record in records:
        points = [(t, hits / (hits + misses)) for t, hits, misses, _, _ in _prefetch_windows(record) if hits + misses]
        if points:
            ax.plot(*zip(*points), label=f"{label} (rate {record.get('rate')})")
    ax.set(xlabel="seconds", ylabel="prefetch hit rate", title="Routed host experts found prefetched", ylim=(0, 1))
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "hit-rate.png")


def plot_host_touches(records, out_dir: str) -> str:
    """Host experts routed a forward step (prefetch hits + misses, or the reads in place), in windows of 1/50 of each
    run: what an eviction order that follows the traffic drives down (the distribution-shift run). Runs whose
    series lack their direct reads are left out."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, record in records:
        if record.get("direct_reads") and "direct_reads" not in record["series"][-1]:
            continue
        points = [(t, (hits + misses + reads) / steps) for t, hits, misses, reads, steps in _prefetch_windows(record)]
        if points:
            ax.plot(*zip(*points), label=f"{label} (rate {record.get('rate')})")
    ax.set(xlabel="seconds", ylabel="host experts routed a step", title="Routed experts that were on the host")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "host-touches.png")


def plot_cost_rule(records, out_dir: str) -> list[str]:
    """For each run of the cost rule (samples with `cost_*` fields, since 480ab55): the link time a step it
    predicted (calibrated) and measured; the experts on the host and the evictions it found profitable; and, where
    the samples carry the rule's inputs, the next nominee's link time against what one eviction may cost and still
    pay (step x requests an expert admits / running requests)."""
    paths = []
    for index, (label, record) in enumerate(records):
        series = [s for s in record["series"] if "cost_calibration" in s]
        if not series:
            continue
        inputs = all("cost_running" in s for s in series)
        t = [s["t"] for s in series]
        fig, panels = plt.subplots(3 if inputs else 2, 1, figsize=(8, 8 if inputs else 6), sharex=True)
        link, counts = panels[0], panels[1]
        predicted = [s["cost_predicted_copy_ms"] * s["cost_calibration"] for s in series]
        link.plot(t, predicted, label="predicted x calibration")
        link.plot(t, [s["cost_measured_copy_ms"] for s in series], label="measured")
        link.set(ylabel="link ms a step", title=f"The cost rule's view: {label} (rate {record.get('rate')})")
        counts.plot(t, [s["offloaded_experts"] for s in series], label="experts on the host")
        counts.plot(t, [s["cost_affordable_evictions"] for s in series], label="profitable evictions left")
        if "cost_profitable_this_refresh" in series[0]:  # records since the vote: what one refresh alone found
            counts.plot(t, [s["cost_profitable_this_refresh"] for s in series], label="...by the last refresh alone",
                        linestyle=":", linewidth=0.8)  # fmt: skip
        counts.set(ylabel="experts")
        if inputs:
            pays = [s["cost_compute_ms"] * s["cost_requests_per_expert"] / max(s["cost_running"], 1e-9) for s in series]
            panels[2].plot(t, [s["cost_next_eviction_ms"] for s in series], label="next nominee's link ms")
            panels[2].plot(t, pays, label="what one eviction may cost (break-even)")
            panels[2].set(ylabel="ms a step", yscale="log")
        panels[-1].set(xlabel="seconds")
        for panel in panels:
            panel.legend(fontsize=7)
        paths.append(_save(fig, out_dir, f"cost-rule-{index}-{label}.png"))
    return paths


def plot_against_rate(records, out_dir: str) -> str:
    """Throughput and mean TTFT per label against the request rate; all-at-once (rate 0) sits at 2x the top rate."""
    finite = [r.get("rate") for _, r in records if r.get("rate")]
    at_once = 2 * max(finite) if finite else 1.0
    by_label = defaultdict(list)
    for label, record in records:
        by_label[label].append((record.get("rate") or at_once, record))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, points in by_label.items():
        points.sort(key=lambda p: p[0])
        left.plot([x for x, _ in points], [r["output_tokens_per_s"] for _, r in points], marker="o", label=label)
        right.plot([x for x, _ in points], [r["ttft_s"]["mean"] for _, r in points], marker="o", label=label)
    left.set(xlabel=f"requests/s (all at once drawn at {at_once:g})", ylabel="output tokens/s", title="Throughput")
    right.set(xlabel="requests/s", ylabel="mean TTFT (s)", title="Time to first token", yscale="log")
    left.legend(fontsize=7)
    return _save(fig, out_dir, "rate.png")


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("records", nargs="+", help="LABEL=record.json")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    records = read_records(args.records, label_of=os.path.basename)
    paths = [plot_concurrency(records, args.out_dir), *plot_pool_split(records, args.out_dir)]
    paths += [plot_hit_rate(records, args.out_dir), plot_host_touches(records, args.out_dir)]
    paths += plot_cost_rule(records, args.out_dir)
    paths.append(plot_against_rate(records, args.out_dir))
    print("\n".join(paths))
    return paths


if __name__ == "__main__":
    main()
