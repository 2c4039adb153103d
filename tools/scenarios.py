"""The GPU measurements, as a table of named scenarios for one device call each; `Session` runs their steps.

    python -P -m tools.scenarios                          # the table: name, rough duration, what it measures
    python -P -m tools.scenarios profile serve            # jobs run in the order given; results under $OUT
    python -P -m tools.scenarios --dry-run scenario       # the commands it would run, run nothing
    MODEL=.bench/qwen1.5-moe-a2.7b STREAM=.bench/stream-200-r0.jsonl bash tools/device_session.sh scenario

The GPU machine runs it through tools/device_session.sh from the repository root, `.bench` carried: MODEL's
config.json and the JSONL streams (`.whl` carried for `serve`). Prepare .bench on the developer machine first (it is
git-ignored):
    mkdir -p .bench/qwen1.5-moe-a2.7b && cp ../shared/models/qwen1.5-moe-a2.7b/config.json .bench/qwen1.5-moe-a2.7b/
    python3 ../shared/workloads/sharegpt_synth.py --num 200 --rate 0 --seed 0 > .bench/stream-200-r0.jsonl
    python3 ../shared/workloads/sharegpt_synth.py --num 400 --rate 0 --seed 0 > .bench/stream-400-r0.jsonl
    python3 ../shared/workloads/sharegpt_synth.py --num 100 --rate 10 --seed 0 > .bench/stream-100-r10.jsonl
and the profiled expert rankings, which save the jobs a minute of profiling each (same seeds and skews):
    cp docs/benchmarks/qwen1.5-moe-skew1-expert_ranking.json .bench/qwen1.5-moe-a2.7b/expert_ranking.json
    cp docs/benchmarks/paper-scenario/expert_ranking-qwen1.5-skew0.5.json \\
       .bench/qwen1.5-moe-a2.7b/expert_ranking-skew0.5.json
    cp docs/benchmarks/paper-scenario/expert_ranking-qwen1.5-skew2.0.json \\
       .bench/qwen1.5-moe-a2.7b/expert_ranking-skew2.0.json
    mkdir -p .bench/qwen3-30b-a3b && cp ../shared/models/qwen3-30b-a3b/config.json .bench/qwen3-30b-a3b/
    cp docs/benchmarks/qwen3-30b-a3b-skew1-expert_ranking.json .bench/qwen3-30b-a3b/expert_ranking.json

Knobs (environment, the same as the shell jobs had): OUT (/tmp/out), MODEL, STREAM, RATE (0), BUDGET (30GiB),
SKEW (1.0), REPEAT, BENCH_FLAGS (to every bench run), POLICIES, PROFILE_FLAGS, GPUTESTS, SERVE_STREAM, TIME_LIMIT_S,
BUDGETS, FIXED, MEMORY_POLICIES, MEMORY_FLAGS, RIMURU_COMMIT, and vsvllm's VS_STREAMS, VS_POLICIES,
VS_VLLM_RECORDS, ORDER, CALL (tools/vs_vllm/scenario.py). Each job's own knobs are in its function's docstring.
"""

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tools import jobs, sweeps
from tools.session import Session
from tools.vs_vllm.scenario import stepvs, vsvllm


@dataclass(frozen=True)
class Scenario:
    name: str
    minutes: str  # rough duration of the job on an H200
    description: str
    run: Callable[[Session], int | None]


SCENARIOS = {s.name: s for s in [
    Scenario("gputests", "~10", "every @pytest.mark.gpu test (ops, models, engine); GPUTESTS=paths narrows it",
             jobs.gputests),
    Scenario("opsgpu", "2", "the @pytest.mark.gpu tests of tests/ops only", jobs.opsgpu),
    Scenario("kernels", "~3", "the split-KV decode attention sweep and the top-k sum (docs/benchmarks/kernels.md)",
             jobs.kernels),
    Scenario("anchors", "2", "the MoE op at M = 1 .. 4096, large M first then small M first, GPU clocks logged",
             jobs.anchors),
    Scenario("launch", "1", "the MoE op's eager launch time beside its GPU time, PDL and L2 hints on and off",
             jobs.launch),
    Scenario("breakdown", "1", "the MoE op piece by piece under CUDA graphs, M = 1..4096", jobs.breakdown),
    Scenario("decodesweep", "1.5", "the decode attention variants against the general kernel", jobs.decodesweep),
    Scenario("tunesmall", "6", "retune both models' M = 1..16 tiles and PAIR_BLOCKS into $OUT/<GPU>.json",
             jobs.tunesmall),
    Scenario("tunelarge", "7-9", "retune M = 512..4096 tiles, GROUP_M in the space (its own call; then breakdown)",
             jobs.tunelarge),
    Scenario("tunewide", "5", "retune Qwen3's M = 1024 over BLOCK_K 128, BLOCK_N 256, 5 stages too", jobs.tunewide),
    Scenario("profile", "~2", "where a decode step of 200 requests spends its time (PROFILE_FLAGS)", jobs.profile),
    Scenario("linearstate", "1", "a hybrid's decode state update at 1, 64, 256 requests against the copy rate",
             jobs.linearstate),
    Scenario("hybrid35", "~15", "Qwen3.5-35B-A3B: no flags beside fixed offloads at 48 GiB, resident and default at 80",
             sweeps.hybrid35),
    Scenario("attnprobe", "2", "decode attention on the engine's own inputs: as called, graph width, compact, after "
             "copies (PROFILE_FLAGS)", jobs.attnprobe),
    Scenario("stepab", "5", "the decode step in this tree and in BASE_TREE, alternated (PROFILE_FLAGS)", jobs.stepab),
    Scenario("hostphases", "2", "the host time of each part of a decode step, paper rule against cost rule",
             jobs.hostphases),
    Scenario("throughput", "~5", "rimuru bench, all experts resident on the whole GPU, the stream at once",
             jobs.throughput),
    Scenario("serve", "~6", "rimuru serve + tools.serving.bench at SERVE_STREAM: TTFT/TPOT/ITL over HTTP", jobs.serve),
    Scenario("scenario", "~8", "rimuru bench at BUDGET: resident, fixed8, elastic8, cost8 at RATE (POLICIES)",
             sweeps.scenario),
    Scenario("defaults", "~5", "elastic at the default offload limit, paper rule and cost rule, at RATE",
             sweeps.defaults),
    Scenario("limits", "~10", "elastic with limits 4, 12, 16 and fixed with 4 and 16 at RATE", sweeps.limits),
    Scenario("direct", "~6", "the MoE op reading host experts in place, then fixed8 and elastic8 reading them",
             sweeps.direct),
    Scenario("qwen3", "~8", "Qwen3-30B-A3B at 40 GiB: fixed56, elastic64, elastic64-direct (POLICIES)", sweeps.qwen3),
    Scenario("defaults3", "~18", "Qwen3-30B-A3B with no policy flags at BUDGETS beside FIXED, a process each",
             sweeps.defaults3),
    Scenario("shift", "~6", "fixed8, elastic8, cost8 on a stream whose prompts move vocabulary halfway", sweeps.shift),
    Scenario("memory", "2", "the activation reserve against start-up, prefill and decode peaks (MEMORY_POLICIES)",
             jobs.memory),
    Scenario("hook", "1", "the routing hook's host time and operations a layer: MODEL fixed8 at BUDGET", jobs.hook),
    Scenario("scheduler", "0.5", "a scheduling round of 140 decodes (against .bench/*_before.py if given)",
             jobs.scheduler),
    Scenario("sampler", "0.5", "a step of 140 sampled requests (against .bench/sampler_before.py if given)",
             jobs.sampler),
    Scenario("vsvllm", "~15", "vLLM and Rimuru on the same config, budget and streams (docs/benchmarks/vs-vllm.md)",
             vsvllm),
    Scenario("stepvs", "~8", "vLLM's and Rimuru's decode step at 1, 16, 64, 256 requests (STEP_BATCHES)", stepvs),
    Scenario("cache", "0.5", "(last) Triton's kernel cache as $OUT/triton-cache.tar.gz.part-* for .bench/",
             jobs.cache),
]}  # fmt: skip


def commit(env: dict[str, str]) -> str:
    """$RIMURU_COMMIT, else this checkout's HEAD, else "unknown": what every record of the call names."""
    # NOTE: give RIMURU_COMMIT literally (RIMURU_COMMIT=480ab55 bash tools/device_session.sh ...): the device's copy
    # of the tree can carry git metadata older than its files, so `git rev-parse` there may name an earlier commit
    if env.get("RIMURU_COMMIT"):
        return env["RIMURU_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def table() -> str:
    width = max(map(len, SCENARIOS))
    rows = [f"  {s.name:<{width}}  {s.minutes:>4} min  {s.description}" for s in SCENARIOS.values()]
    return "python -m tools.scenarios [--dry-run] NAME..., NAME one of:\n" + "\n".join(rows)


def main(argv: list[str], env: dict[str, str]) -> int:
    dry_run = "--dry-run" in argv
    names = [a for a in argv if a != "--dry-run"]
    unknown = [n for n in names if n not in SCENARIOS]
    if not names or unknown:
        print(table())
        return 2 if unknown else 0
    session = Session(env | {"RIMURU_COMMIT": commit(env)}, dry_run)
    session.do(f"mkdir -p {session.out}", lambda: session.out.mkdir(parents=True, exist_ok=True))
    failed = False
    for name in names:
        session.say(f"== {name}")
        failed |= bool(SCENARIOS[name].run(session))
    return int(failed)


if __name__ == "__main__":
    import os

    sys.exit(main(sys.argv[1:], dict(os.environ)))
