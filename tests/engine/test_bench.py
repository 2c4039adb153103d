"""`rimuru bench` on the CPU with the tiny model and a budget that forces evictions, and the plots from its records,
so the benchmark behind the published figures cannot rot."""

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from rimuru.benchmark import SERIES_ESTIMATES, read_stream, source_commit
from rimuru.serving.cli import main
from tests.engine.conftest import expect_no_growth
from tests.engine.test_experts import budget_for
from tools.engine import adjuster as bench_adjuster
from tools.engine import shift_stream, simulate_queue
from tools.engine import sweep as bench_sweep
from tools.reports import plot as plot_bench
from tools.reports import table as bench_table


def write_stream(path: Path, num: int, vocab_size: int) -> list[dict]:
    rng = random.Random(0)
    requests = [{"id": f"req-{i}", "arrival": round(i * 0.01, 3), "max_tokens": rng.randint(4, 24),
                 "prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 60))]}
                for i in range(num)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return requests


def test_bench_record_is_consistent_and_plots(family, tmp_path, capsys):
    folder = family[0]
    requests = write_stream(tmp_path / "stream.jsonl", 36, 512)
    budget = str(budget_for(folder, kv_tokens=60, offload=3))
    records = {}
    for policy, rate in [("elastic", "0"), ("elastic", "100"), ("resident", "0")]:
        out = tmp_path / f"{policy}-{rate}.json"
        # the paper's rule: it evicts whenever pages run short, so the record's expert counters are exercised
        extra = ["--expert-offload-limit", "3", "--gpu-memory-budget", budget, "--adjuster", "paper"] \
            if policy == "elastic" else []  # fmt: skip
        extra += ["--expert-reads", "copy"] if rate == "0" else []  # 100/s: the default, direct reads
        args = ["bench", folder, "--stream", str(tmp_path / "stream.jsonl"), "--rate", rate, "--out", str(out),
                "--expert-policy", policy, "--quiet", *extra]  # fmt: skip
        assert main(args) == 0
        records[(policy, rate)] = record = json.loads(out.read_text())
        assert record["output_tokens"] == sum(r["max_tokens"] for r in requests)
        assert record["commit"] == source_commit()
        # async scheduling: a round with nothing to run only reads the tokens of the one before; at once, the last
        idle_rounds = len(record["series"]) - record["forward_steps"]
        assert idle_rounds == 1 if rate == "0" else idle_rounds >= 1
        assert record["peak_concurrency"] == max(s["running"] for s in record["series"]) <= 256
        assert 0 < record["ttft_s"]["median"] <= record["ttft_s"]["p99"]
        assert sum(s["tokens"] for s in record["series"]) == record["output_tokens"]
    elastic = records[("elastic", "0")]
    assert elastic["evictions"] > 0 and elastic["bytes_copied"] > 0 and elastic["prefetch_hit_rate"] is not None
    last = elastic["series"][-1]  # the series counts cumulatively what the record sums up
    hits, misses = last["prefetch_hits"], last["prefetch_misses"]
    assert round(hits / (hits + misses), 4) == elastic["prefetch_hit_rate"]
    assert records[("elastic", "100")]["prefetch_hit_rate"] is None  # direct reads: nothing prefetched
    paths = plot_bench.main([str(tmp_path / "plots")] + [f"{p}={tmp_path / f'{p}-{r}.json'}" for p, r in records])
    assert len(paths) == 7 and all(Path(p).stat().st_size > 10_000 for p in paths)
    text = bench_table.main([f"{p}-{r}={tmp_path / f'{p}-{r}.json'}" for p, r in records])
    lines = text.splitlines()
    assert len(lines) == 2 + len(records) and all(line.count("|") == lines[0].count("|") for line in lines)
    assert f"| elastic-0 | {elastic['output_tokens_per_s']:,.1f} | 1.00 |" in text


def test_the_table_flags_a_run_that_went_past_its_budget():
    """Peak reserved memory above the run's `gpu_memory_budget` is named in its cell; at or under it, not."""
    record = {"peak_reserved_bytes": int(30.5 * 2**30), "engine": {"gpu_memory_budget": "30GiB"}}
    assert bench_table._reserved(record) == "30.50 GiB (over the 30.00 GiB budget)"
    assert bench_table._reserved({**record, "peak_reserved_bytes": 29 * 2**30}) == "29.00 GiB"
    assert bench_table._reserved({**record, "engine": {"gpu_memory_budget": None}}) == "30.50 GiB"
    assert bench_table._reserved({"peak_reserved_bytes": None}) == "-"
    with_allocated = {**record, "peak_allocated_bytes": 29 * 2**30}
    assert bench_table._reserved(with_allocated) == "30.50 GiB (over the 30.00 GiB budget; 29.00 GiB allocated)"


def test_the_cost_adjusters_record_counts_its_own_run(family, tmp_path):
    """The cost adjuster's estimates appear in `expert_stats` during the run; the record's counters start at zero
    after the warm-up all the same."""
    folder = family[0]
    write_stream(tmp_path / "stream.jsonl", 24, 512)
    budget = str(budget_for(folder, kv_tokens=60, offload=3))
    out = tmp_path / "cost.json"
    args = ["bench", folder, "--stream", str(tmp_path / "stream.jsonl"), "--rate", "0", "--out", str(out), "--quiet",
            "--expert-offload-limit", "3", "--gpu-memory-budget", budget, "--adjuster", "cost"]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    counters = ("evictions", "additions", "swaps", "bytes_copied", "hook_seconds", "routing_wait_seconds")
    assert record["forward_steps"] > 0 and all(record[key] >= 0 for key in counters)
    assert 0 < record["adjuster_seconds"] < record["wall_s"]  # the rule's host time
    measured = [s for s in record["series"] if "cost_calibration" in s]  # the rule's view, once it has measured
    assert measured and all(set(SERIES_ESTIMATES) <= s.keys() for s in measured)
    assert record["series"][-1]["direct_reads"] == record["direct_reads"]  # cumulative, like the prefetch counters
    phases = ("schedule_ms", "adjust_ms", "forward_ms", "expert_changes_ms", "observe_ms")
    steps = list(zip(record["series"], record["series"][1:]))
    assert all(set(phases) <= s.keys() for s in record["series"])  # where each step's wall time went
    assert all(sum(s[p] for p in phases) <= (s["t"] - before["t"]) * 1e3 + 0.1 for before, s in steps)
    assert sum(s["adjust_ms"] + s["observe_ms"] for s in record["series"]) / 1e3 <= record["adjuster_seconds"] + 0.01
    lines = bench_table.main(["--phases", f"cost={out}"]).splitlines()  # the phases by band of running requests
    gzipped = tmp_path / "cost.json.gz"  # how docs/benchmarks keeps long records
    gzipped.write_bytes(gzip.compress(out.read_bytes()))
    assert bench_table.main(["--phases", f"cost={gzipped}"]).splitlines() == lines
    assert lines[2].startswith("| cost | 0-7 |") and all(line.count("|") == lines[0].count("|") for line in lines)
    assert sum(int(line.split("|")[3].replace(",", "")) for line in lines[2:]) == len(record["series"]) - 1
    older = tmp_path / "older.json"  # a record from before the phases: refused, not shown as all "outside"
    older.write_text(json.dumps(record | {"series": [{k: v for k, v in s.items() if k[:-3] not in bench_table.PHASES}
                                                     for s in record["series"]]}))  # fmt: skip
    with pytest.raises(SystemExit, match="no step phases"):
        bench_table.main(["--phases", f"older={older}"])
    paths = plot_bench.main([str(tmp_path / "plots"), f"cost={out}"])
    assert any(p.endswith("cost-rule-0-cost.png") for p in paths)


def test_a_time_limit_records_the_part_that_ran_and_frees_the_rest(family, tmp_path):
    from rimuru import LLM
    from rimuru.benchmark import run_benchmark

    folder = family[0]
    requests = write_stream(tmp_path / "stream.jsonl", 12, 512)
    engine = LLM(folder, progress=False).engine
    free = engine.allocator.stats()["free_expert_pages"]
    whole = run_benchmark(engine, requests, progress=False)
    assert whole["truncated_at_s"] is None and whole["finished_requests"] == len(requests)
    late = [dict(r, arrival=r["arrival"] + (60.0 if i >= 6 else 0.0)) for i, r in enumerate(requests)]
    # the first six finish (twice the whole run's time: a busy CI machine must not starve them), the rest would
    # arrive a minute later
    limit = 2 * whole["wall_s"] + 1.0
    cut = run_benchmark(engine, late, progress=False, time_limit_s=limit)
    # wall_s is rounded to the millisecond, the limit is not
    assert limit - 1e-3 <= cut["wall_s"] < limit + 0.5 and cut["truncated_at_s"] == cut["wall_s"]
    assert cut["finished_requests"] == 6 and cut["output_tokens"] == sum(r["max_tokens"] for r in requests[:6])
    assert not engine.has_unfinished() and engine.allocator.stats()["free_expert_pages"] == free


def test_sweep_repeats_the_list_in_turn_and_reports_the_spread(family, tmp_path, monkeypatch, capsys):
    import rimuru.engine

    # the sweep caches the load and checks host memory on the first one only: both restored after
    monkeypatch.setattr(rimuru.engine, "from_pretrained", rimuru.engine.from_pretrained)
    monkeypatch.setattr(rimuru.engine, "check_host_memory", rimuru.engine.check_host_memory)
    write_stream(tmp_path / "stream.jsonl", 6, 512)
    out = tmp_path / "sweep"
    common = f"--stream {tmp_path / 'stream.jsonl'} --rate 0 --quiet --warmup 0"
    runs = ["--run", "resident=--expert-policy resident", "--run", "fixed=--expert-policy fixed"]
    monkeypatch.setattr(sys, "argv", ["bench_sweep.py", family[0], "--out-dir", str(out), "--repeat", "2",
                                      "--common", common, *runs])  # fmt: skip
    bench_sweep.main()
    printed = capsys.readouterr().out
    records = sorted(p.name for p in out.glob("*.json"))
    assert records == ["fixed-2.json", "fixed.json", "resident-2.json", "resident.json"]
    order = [line.split(":")[0] for line in printed.splitlines() if "exit 0" in line]
    assert order == ["resident", "fixed", "resident-2", "fixed-2"]
    spans = (out / "runs.txt").read_text().splitlines()  # each run's wall-clock span, to line up with GPU clocks
    assert [line.split(":")[0] for line in spans] == order and all(line.count(":") == 5 for line in spans)
    values = [json.loads((out / f"resident{s}.json").read_text())["output_tokens_per_s"] for s in ("", "-2")]
    assert f"resident: {values[0]:.1f} {values[1]:.1f} tok/s, spread {bench_sweep.spread(values):.1%}" in printed
    assert bench_sweep.spread([90.0, 110.0]) == 0.2


def test_shift_stream_moves_the_second_half_of_the_arrivals_to_the_other_part(tmp_path):
    requests = write_stream(tmp_path / "stream.jsonl", 9, 5000)[::-1]  # arrival order is restored
    shifted = shift_stream.shift(requests, vocab_size=1000)
    assert [r["id"] for r in shifted] == [f"req-{i}" for i in range(9)]
    for i, (before, after) in enumerate(zip(sorted(requests, key=lambda r: r["arrival"]), shifted)):
        low, high = (0, 500) if i < 4 else (500, 1000)
        assert len(after["prompt_token_ids"]) == len(before["prompt_token_ids"])
        assert all(low <= t < high for t in after["prompt_token_ids"])


def test_profile_step_prints_the_hooks_share_of_an_offloaded_step(family, tmp_path, monkeypatch, capsys):
    """`tools/engine/profile_step.py` as the device session runs it, on the CPU: fixed offloading, graphs' padded path."""
    from tools.engine import profile_step

    write_stream(tmp_path / "stream.jsonl", 8, 512)
    argv = ["profile_step.py", family[0], "--stream", str(tmp_path / "stream.jsonl"), "--steps", "2",
            "--num-requests", "4", "--expert-policy", "fixed", "--offload-per-layer", "2", "--cuda-graphs",
            "--mixed-cuda-graphs", "--device", "cpu"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_step.main()
    printed = capsys.readouterr().out
    assert "decode step, 4 running" in printed and "of it, waiting for the router" in printed


def test_measure_memory_runs_every_phase_and_reports_the_plan(family, tmp_path, monkeypatch, capsys):
    """`tools/engine/memory.py` on the CPU: the three phases run on the tiny model (no CUDA statistics here, so
    the peaks are None) and the record carries the plan the engine made."""
    from tools.engine import memory as measure_memory

    out = tmp_path / "memory.json"
    argv = ["measure_memory.py", family[0], "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--device", "cpu",
            "--cuda-graphs", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    measure_memory.main()
    record = json.loads(out.read_text())
    assert list(record["phases"]) == ["start-up", "prefill", "decode"]
    assert record["plan"]["pool"] > 0 and record["plan"]["activation_reserve"] > 0
    assert "plan: budget" in capsys.readouterr().out


def test_records_name_their_commit(monkeypatch):
    """A bench record carries the commit the environment names ($RIMURU_COMMIT: the device session sets it), else
    none: the engine never runs git."""
    import subprocess

    monkeypatch.setenv("RIMURU_COMMIT", "abc1234")
    assert source_commit() == "abc1234"
    monkeypatch.delenv("RIMURU_COMMIT")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the engine ran a subprocess"))
    assert source_commit() is None


def test_bench_hook_times_every_layer_and_counts_operations(family, tmp_path, monkeypatch, capsys):
    """`tools/engine/hook.py` on the CPU: the routing hook called on every MoE layer of the tiny model with experts
    on the host, a row a batch size with its operation count."""
    from tools.engine import hook as bench_hook

    out = tmp_path / "hook.json"
    argv = ["bench_hook.py", family[0], "--device", "cpu", "--expert-policy", "fixed", "--offload-per-layer", "2",
            "--tokens", "1", "4", "--steps", "3", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_hook.main()
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 4]
    assert all(row["hook_us"] > 0 and row["operations"] > 0 for row in rows)
    assert "experts on the host" in capsys.readouterr().out


def test_the_adjuster_benchmark_times_both_rules_on_a_placement_that_refreshes(capsys, monkeypatch):
    """`tools/engine/adjuster.py`: both rules run their rounds (the cost rule's refreshes and swap tests among them)
    and the placement stays as given: nothing is short or free, so nothing moves."""
    monkeypatch.setattr(sys, "argv", ["bench_adjuster.py", "--layers", "3", "--experts", "8", "--offloaded", "2",
                                      "--limit", "4", "--rounds", "40"])  # fmt: skip
    bench_adjuster.main()
    line = capsys.readouterr().out
    assert "3 layers x 8 experts, 6 on the host" in line and "paper rule" in line and "cost rule" in line
    offloaded = {0: {7}, 1: set(), 2: set()}
    adjuster = bench_adjuster.cost_adjuster(bench_adjuster.skewed_ranking(3, 8), offloaded, 4)
    adjuster.observe(12e-3, 40, [], 32, 30_000)  # the first measured round asks for a refresh
    adjuster.refresh_if_due()
    assert adjuster.estimates["cost_measured"] == 1 and adjuster.estimates["cost_next_eviction_ms"] > 0



def test_the_queue_simulation_serves_every_request_and_a_full_reserve_never_preempts(tmp_path, monkeypatch):
    """`tools/engine/simulate_queue.py` runs the engine's scheduler to the end: every request gets its first token, the
    throughput counts every output token, a capacity too small for the burst preempts, and admission that reserves
    each running request's whole remaining output (`--reserve 1`) never has to."""
    stream = [dict(r, arrival=0.0) for r in write_stream(tmp_path / "s.jsonl", 40, 500)]
    args = simulate_queue.argparse.Namespace(step_ms=4.0, per_request_ms=0.2, per_prefill_token_ms=0.01,
                                             max_num_seqs=256, max_num_batched_tokens=512)  # fmt: skip
    expect_no_growth(monkeypatch)  # the scheduler admits on today's pages: a tight pool preempts
    tight = simulate_queue.simulate(stream, 12, args)
    reserved = simulate_queue.simulate(stream, 12, args, reserve=1.0)
    roomy = simulate_queue.simulate(stream, 400, args)
    assert tight["preemptions"] > 0 and reserved["preemptions"] == 0 and roomy["preemptions"] == 0
    assert tight["output_tokens"] == reserved["output_tokens"] == roomy["output_tokens"] == sum(
        r["max_tokens"] for r in stream)
    assert roomy["ttft_mean_s"] < tight["ttft_mean_s"]


def test_the_wide_tile_space_adds_larger_tiles_at_large_m_only():
    """`tools/kernels/tune.py --wide`: at large M the space also holds BLOCK_K 128, BLOCK_N 256 and 5 stages (over
    BLOCK_M 128 and two program orders); decode's space is the same either way."""
    from tools.kernels import tune as tune_kernels

    block_ms, tiles = tune_kernels.search_space(64, wide=True)
    assert block_ms == [128] and len(tiles) == 72
    assert {t["BLOCK_K"] for t in tiles} == {64, 128} and max(t["BLOCK_N"] for t in tiles) == 256
    assert {t["GROUP_M"] for t in tiles} == {0, 8} and max(t["num_stages"] for t in tiles) == 5
    assert len(tune_kernels.search_space(64)[1]) == 40
    assert tune_kernels.search_space(1, wide=True) == tune_kernels.search_space(1)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    ('{"id": "b", "arrival": 0, "prompt_token_ids": [1, 2]}', "line 2: a request needs 'max_tokens'"),
    ('["id", "arrival"]', "line 2: a request needs 'id'"),
])  # fmt: skip
def test_a_stream_line_that_is_not_a_request_is_refused_naming_its_line(tmp_path, line, message):
    path = tmp_path / "stream.jsonl"
    path.write_text(json.dumps({"id": "a", "arrival": 0.5, "prompt_token_ids": [3], "max_tokens": 2}) + f"\n{line}\n")
    with pytest.raises(ValueError, match=f"^{path} {message}"):
        read_stream(str(path))
    path.write_text(path.read_text().splitlines()[0] + "\n\n")  # blank lines pass
    assert [r["id"] for r in read_stream(str(path))] == ["a"]
