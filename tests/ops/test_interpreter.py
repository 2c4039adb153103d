"""Runs `interp_kernels.py` (`ref` vs `tri` for every kernel) under the Triton interpreter in a subprocess
(`tests/interpreter.py` says why), and the kernel tools' smoke runs likewise."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.interpreter import pytest_under_interpreter

HERE = Path(__file__).parent


def test_kernels_under_triton_interpreter():
    pytest_under_interpreter(HERE / "interp_kernels.py", parallel=True)


def test_direct_reads_benchmark_runs_and_matches_resident(tmp_path):
    """`tools/kernels/direct_reads.py --smoke`: the benchmark behind the direct-read figures cannot rot, and host reads
    give the resident op's output at every point it times."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "direct.json"
    cmd = [sys.executable, "-m", "tools.kernels.direct_reads", "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["equal_to_resident"] for r in rows)


def test_kernel_sweep_times_the_points_in_the_order_given(tmp_path):
    """`tools/kernels/bench.py --smoke --skip-attention --m 8 1`: large M first (the `anchors` job), each row
    stamped with its start so a clock log can be matched, and the paged GEMMs equal the identity-table ones."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "tools.kernels.bench", "--smoke", "--skip-attention",
           "--m", "8", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["moe"]
    assert [r["M"] for r in rows] == [8, 1] and "attention_decode" not in report
    assert rows[0]["started_unix_s"] <= rows[1]["started_unix_s"]
    assert rows[1]["paged_equals_identity"] and rows[1]["rel_err_vs_fp32_ref"] < 1e-5


def test_launch_benchmark_runs(tmp_path):
    """`tools/kernels/launch.py --smoke`: the host time of the GEMMs and of the op, for every config variant."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "launch.json"
    cmd = [sys.executable, "-m", "tools.kernels.launch", "--smoke", "--m", "1", "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["table", "no PDL", "no L2 hints"]
    assert all(r["gemms_host_us"] > 0 and r["op_host_us"] > 0 for r in rows)
    assert [r["config"].get("PDL", False) for r in rows][1] is False


def test_moe_breakdown_runs(tmp_path):
    """`tools/kernels/bench.py --breakdown --smoke`: every piece is timed and the Triton top-k sum equals torch's."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "breakdown.json"
    cmd = [sys.executable, "-m", "tools.kernels.bench", "--breakdown", "--smoke", "--out",
           str(out)]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["breakdown"]
    assert len(rows) == 3 and all(r["casts_noop"] and r["op_rel_diff_vs_torch_sum"] < 1e-6 for r in rows)
    assert [r["atomic_sort_equal"] for r in rows if "op_atomic_sort_us" in r] == [True, True]  # M = 3 and 70 sort
    assert all(r["op_counted_sort_us"] > 0 for r in rows if "op_atomic_sort_us" in r)
    assert all(r["pdl_equal"] and r["op_pdl_us"] > 0 and r["op_plain_launch_us"] > 0 for r in rows)
    assert all(r["l2_hints_equal"] and r["op_l2_hints_us"] > 0 and r["op_no_hints_us"] > 0 for r in rows)
    assert [r["M"] for r in rows if "pair_block_gemms_us" in r] == [3]


def test_tuner_runs(tmp_path):
    """`tools/kernels/tune.py --smoke`: a decode bucket and a large one (whose space holds GROUP_M) are tuned and
    stored."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "table.json"
    cmd = [sys.executable, "-m", "tools.kernels.tune", "--smoke", "--m", "1", "200",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (buckets,) = json.loads(out.read_text()).values()
    assert sorted(buckets, key=int) == ["1", "200"] and "GROUP_M" in buckets["200"] and "DOWN_GROUP_M" in buckets["200"]


def test_decode_attention_sweep_runs(tmp_path):
    """`tools/kernels/decode_attention.py --smoke`: every stage runs and every variant matches the reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "tools.kernels.decode_attention", "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["target"] + report["shapes"]
    assert len(report["finalists"]) == 3 and len(rows) == 21 and all("us" in r for r in rows)


def test_the_sorts_kernels_compile_for_the_h200_without_spilling():
    """`tools/kernels/resources.py`: the sort's kernels at the tiles the op takes (64 pairs for 128 experts, 128 for
    60) compile for sm_90 on this CPU machine, and none spills (no stack frame, no local memory)."""
    cmd = [sys.executable, "-m", "tools.kernels.resources", "--experts", "60", "128", "--tiles", "64", "128"]
    done = subprocess.run(cmd, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if "REG:" in line]
    assert len(rows) == 16
    taken = [r for r in rows if r.startswith(("E=60 tile=128", "E=128 tile=64"))]
    for row in taken:
        assert " STACK:0" in row and " LOCAL:0" in row, row


def test_small_batch_attention_sweep_runs(tmp_path):
    """`tools/kernels/small_batch_attention.py --smoke`: every variant it times (the dispatcher, the unsplit kernel,
    split counts and minimum split lengths) is checked against the fp32 reference first and passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "sba.json"
    cmd = [sys.executable, "-m", "tools.kernels.small_batch_attention", "--smoke", "--models", "qwen3-30b-a3b",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r for r in rows if "error" in r] == []
    names = [r["name"] for r in rows]
    assert names[:2] == ["dispatcher", "decode kernel, unsplit"] and any(n.startswith("split 2") for n in names)
    assert all(r["rel_err"] < 1e-5 for r in rows)
