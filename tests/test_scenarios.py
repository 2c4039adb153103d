"""The GPU jobs' table (tools/scenarios.py) on the CPU: every job dispatches, and under --dry-run prints the commands
it would run on the device, with the environment knobs the shell jobs had, and runs none of them."""

import subprocess

import pytest

from tools import scenarios
from tools.sweeps import policy_spec

ENV = {"OUT": "/tmp/out", "RIMURU_COMMIT": "abc1234", "PATH": "/usr/bin:/bin"}


@pytest.fixture
def dry(monkeypatch, capsys):
    """`python -m tools.scenarios --dry-run NAME...` with `knobs`: its printed lines; nothing may run."""
    refuse = lambda *a, **k: pytest.fail(f"ran {a[0] if a else k}")
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)

    def run(*names: str, **knobs: str) -> list[str]:
        assert scenarios.main(["--dry-run", *names], ENV | knobs) == 0
        return capsys.readouterr().out.splitlines()

    return run


def test_the_table_lists_every_job_and_refuses_an_unknown_one(capsys):
    assert scenarios.main([], ENV) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in scenarios.SCENARIOS)
    assert scenarios.main(["--dry-run", "scenario", "nosuchjob"], ENV) == 2  # nothing runs, not even the first
    assert "== scenario" not in capsys.readouterr().out


def test_every_job_dry_runs(dry):
    for name in scenarios.SCENARIOS:
        lines = dry(name)
        assert lines[1] == f"== {name}" and len(lines) > 2, name


def test_the_sweep_jobs_pass_the_knobs_on(dry):
    lines = dry("scenario", POLICIES="resident cost4-slo2-mixed", RATE="5", BUDGET="20GiB", SKEW="0.5",
                REPEAT="2", BENCH_FLAGS="--time-limit-s 60")  # fmt: skip
    (sweep,) = [line for line in lines if "-m tools.engine.sweep" in line]
    assert "--out-dir /tmp/out/scenario-r5 " in sweep and "--repeat 2 " in sweep
    assert "expert_ranking-skew0.5.json" in sweep and "--router-skew 0.5" in sweep
    assert "--rate 5 --gpu-memory-budget 20GiB" in sweep and "--time-limit-s 60" in sweep
    assert "'cost4-slo2-mixed=--expert-policy elastic --adjuster cost --expert-offload-limit 4 --mixed-cuda-graphs " \
           "--ttft-slo 2'" in sweep  # fmt: skip
    assert lines[-2:] == ["tar -czf /tmp/out/scenario-r5.tar.gz -C /tmp/out scenario-r5", "rm -r /tmp/out/scenario-r5"]


def test_qwen3_jobs_take_their_own_model_budget_and_time_limit(dry):
    (sweep,) = [line for line in dry("qwen3") if "-m tools.engine.sweep" in line]
    assert sweep.split()[4] == ".bench/qwen3-30b-a3b" and "--gpu-memory-budget 40GiB" in sweep
    assert "--time-limit-s 120" in sweep and "'elastic64-direct=" in sweep
    sweeps = [line for line in dry("defaults3", BUDGETS="24 32", FIXED="fixed64") if "-m tools.engine.sweep" in line]
    assert len(sweeps) == 4 and all("--time-limit-s 90" in line for line in sweeps)
    assert "--out-dir /tmp/out/qwen3-32g-fixed64-r0 " in sweeps[3] and "--gpu-memory-budget 32GiB" in sweeps[3]


def test_vsvllm_runs_the_engines_in_the_order_asked_and_merges_the_call(dry):
    lines = dry("vsvllm", VS_STREAMS=".bench/a.jsonl", ORDER="rimuru-first", CALL="7")
    rimuru = next(i for i, line in enumerate(lines) if "-m tools.engine.sweep" in line)
    vllm = next(i for i, line in enumerate(lines) if "tools/vs_vllm/replay.py" in line)
    assert rimuru < vllm and "source /tmp/vsite/env.sh" in lines[vllm] and "--budget-gib 30 " in lines[vllm]
    assert "'resident-a=--expert-policy resident --stream .bench/a.jsonl'" in lines[rimuru]
    assert "'default-a=--stream .bench/a.jsonl'" in lines[rimuru]
    (table,) = [line for line in lines if "-m tools.vs_vllm.table" in line]
    assert "--call 7 --commit abc1234 " in table and table.endswith("vllm=/tmp/out/vs/vllm-a.json "
                                                                   "resident=/tmp/out/vs/resident-a.json "
                                                                   "default=/tmp/out/vs/default-a.json")  # fmt: skip
    earlier = dry("vsvllm", VS_VLLM_RECORDS="/tmp/last")  # vLLM's records of an earlier call: neither installed nor run
    assert not any("install.sh" in line or "replay.py" in line for line in earlier)
    assert "# cp /tmp/last/vllm-*.json /tmp/out/vs/" in earlier


def test_policy_names_give_the_flags_the_shell_gave():
    assert policy_spec("default") == "default="
    assert policy_spec("fixed8") == "fixed8=--expert-policy fixed --offload-per-layer 8"
    assert policy_spec("elastic") == "elastic=--expert-policy elastic --adjuster paper"
    assert policy_spec("elastic8-direct") == \
        "elastic8-direct=--expert-policy elastic --adjuster paper --expert-offload-limit 8 --expert-reads direct"
    assert policy_spec("cost-slo2") == "cost-slo2=--expert-policy elastic --adjuster cost --ttft-slo 2"
    assert policy_spec("default-copy") == "default-copy= --expert-reads copy"
    with pytest.raises(ValueError, match="unknown policy resident4"):
        policy_spec("resident4")
