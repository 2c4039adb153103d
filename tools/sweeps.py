"""The GPU jobs of tools/scenarios.py that sweep `rimuru bench` over policies by name, one process a job
(tools/engine/sweep.py: the checkpoint loaded once), and `policy_spec`, the names' flags.

Knobs: MODEL, STREAM, RATE, BUDGET, SKEW (the router skew, 1.0; the ranking file follows it), REPEAT (the list run
that many times in turn, each policy's spread printed), BENCH_FLAGS (to every run, e.g. "--time-limit-s 120"),
POLICIES (scenario's and qwen3's set), TIME_LIMIT_S (qwen3: 120, defaults3: 90), BUDGETS and FIXED (defaults3).
"""

import json
from pathlib import Path

from tools.session import Session, first_line, tail

BASES = {"resident": "--expert-policy resident", "elastic": "--expert-policy elastic --adjuster paper",
         "cost": "--expert-policy elastic --adjuster cost"}  # fmt: skip
SUFFIXES = {"-direct": " --expert-reads direct", "-copy": " --expert-reads copy", "-mixed": " --mixed-cuda-graphs"}


def policy_spec(name: str) -> str:
    """`NAME=FLAGS` for tools/engine/sweep.py's --run, from a policy's name: default (no policy flags: what a user
    gets), resident, fixedN, elasticN (the paper rule: --adjuster paper since the cost rule became the default),
    costN, elastic and cost (the default offload limit), each with any of the suffixes -copy (host experts copied
    in: the routing hook and the prefetch), -direct (the kernels read host experts in place, as a plain name does
    now), -mixed (steps with prefill replay CUDA graphs too) and -sloS (the cost rule evicts despite the cost once a
    request has waited S seconds: --ttft-slo S), e.g. elastic-copy-mixed, cost-slo2. ValueError for another name."""
    base, extra = name, ""
    while True:
        suffix = next((x for x in SUFFIXES if base.endswith(x)), None)
        if suffix:
            base, extra = base.removesuffix(suffix), extra + SUFFIXES[suffix]
        elif "-slo" in base:
            base, _, seconds = base.rpartition("-slo")
            extra += f" --ttft-slo {seconds}"
        else:
            break
    return f"{name}={_base_flags(name, base)}{extra}"


def _base_flags(name: str, base: str) -> str:
    if base == "default":
        return ""
    if base in BASES:
        return BASES[base]
    for prefix, limit in (("fixed", "--offload-per-layer"), ("elastic", "--expert-offload-limit"),
                          ("cost", "--expert-offload-limit")):  # fmt: skip
        if base.startswith(prefix):
            policy = "--expert-policy fixed" if prefix == "fixed" else BASES[prefix]
            return f"{policy} {limit} {base.removeprefix(prefix)}"
    raise ValueError(f"unknown policy {name}")


def skew_flags(s: Session) -> str:
    return f"--router-skew {s.knob('SKEW', '1.0')}"


def ranking_path(s: Session) -> str:
    """MODEL's profiled ranking at SKEW (the sweep profiles it when missing): expert_ranking.json at the default skew
    of 1.0, expert_ranking-skew<S>.json at another."""
    skew = s.knob("SKEW", "1.0")
    return f"{s.model}/expert_ranking.json" if skew == "1.0" else f"{s.model}/expert_ranking-skew{skew}.json"


def sweep(s: Session, name: str, stream: str, ranking: str, skew: str, specs: list[str]) -> None:
    """One sweep process over `specs`, then the throughput lines, and every record and log in $OUT/NAME.tar.gz
    (8 files at most come back from a call)."""
    folder = s.out / name
    s.do(f"mkdir -p {folder}", lambda: folder.mkdir(parents=True, exist_ok=True))
    dummy = " ".join(s.dummy)
    common = (f"--stream {stream} --rate {s.rate} --gpu-memory-budget {s.budget} {skew} --max-num-batched-tokens 2048"
              f" --quiet {dummy} {s.knob('BENCH_FLAGS')}")  # fmt: skip
    profile = f"{dummy} {skew} --workload {stream} --num-prompts 64 --max-tokens 8 --expert-policy resident"
    runs = [arg for spec in specs for arg in ("--run", spec)]
    with s.clocks(folder / "gpu-clocks.csv"):
        s.run(s.tool("tools.engine.sweep", s.model, "--out-dir", folder, "--ranking", ranking, "--repeat",
                     s.knob("REPEAT", "1"), "--common", common, "--profile", profile, *runs))  # fmt: skip
    s.run(["cp", ranking, f"{folder}/"], stderr="drop")
    s.do("print each log's throughput line", lambda: print_throughputs(s, folder))
    pack(s, name)


def print_throughputs(s: Session, folder: Path) -> None:
    for log in sorted(folder.glob("*.log")):
        s.say(f"{log.name} {first_line(log, 'output_tokens_per_s')}")


def pack(s: Session, name: str) -> None:
    """$OUT/NAME/ as $OUT/NAME.tar.gz, the folder removed once packed."""
    if s.run(["tar", "-czf", f"{s.out / name}.tar.gz", "-C", s.out, name]) == 0:
        s.run(["rm", "-r", s.out / name])


def policies(s: Session, name: str, stream: str, ranking: str, skew: str, names: list[str]) -> int:
    """`sweep` over policies given by name; 1 (and nothing run) for an unknown name."""
    try:
        specs = [policy_spec(policy) for policy in names]
    except ValueError as error:
        s.say(str(error))
        return 1
    sweep(s, name, stream, ranking, skew, specs)
    return 0


def scenario(s: Session) -> int:
    names = s.knob("POLICIES", "resident fixed8 elastic8 cost8").split()
    return policies(s, f"scenario-r{s.rate}", s.stream, ranking_path(s), skew_flags(s), names)


def defaults(s: Session) -> int:
    """What a user gets without tuning: elastic at the default limit, both adjusters."""
    return policies(s, f"defaults-r{s.rate}", s.stream, ranking_path(s), skew_flags(s), ["elastic", "cost"])


def limits(s: Session) -> int:
    """The paper scenario's sweeps: elastic at offload limits 4, 12, 16, fixed at 4 and 16."""
    names = ["elastic4", "elastic12", "elastic16", "fixed4", "fixed16"]
    return policies(s, f"limits-r{s.rate}", s.stream, ranking_path(s), skew_flags(s), names)


def direct(s: Session) -> int:
    """The MoE op reading host experts in place (tools/kernels/direct_reads.py), then fixed8 and elastic8 reading."""
    s.run(s.tool("tools.kernels.direct_reads", "--out", s.out / "direct_reads.json"), show=tail(18))
    names = ["fixed8-direct", "elastic8-direct"]
    return policies(s, f"direct-r{s.rate}", s.stream, ranking_path(s), skew_flags(s), names)


def qwen3(s: Session) -> int:
    """The does-not-fit scenario: Qwen3-30B-A3B (58 GB of experts) on a 40 GiB card."""
    # NOTE: the pool holds about 65% of the experts, so at least 48 of each layer's 128 must live on the host
    # NOTE: PCIe-bound (a step copies or reads several GB of host experts): each run stops at TIME_LIMIT_S (120) and
    # records the part that ran (truncated_at_s); use a short stream such as .bench/stream-100-r10.jsonl
    flags = f"--time-limit-s {s.knob('TIME_LIMIT_S', '120')} {s.knob('BENCH_FLAGS')}"
    q = s.with_knobs(MODEL=".bench/qwen3-30b-a3b", BUDGET="40GiB", BENCH_FLAGS=flags)
    names = s.knob("POLICIES", "fixed56 elastic64 elastic64-direct").split()
    return policies(q, f"qwen3-40g-r{q.rate}", q.stream, ranking_path(q), skew_flags(q), names)


def defaults3(s: Session) -> int:
    """Qwen3-30B-A3B with no policy flags at BUDGETS (24 32 40 GiB) beside FIXED (fixed64 fixed80 fixed96)."""
    flags = f"--time-limit-s {s.knob('TIME_LIMIT_S', '90')} {s.knob('BENCH_FLAGS')}"
    failed = 0
    for budget in s.knob("BUDGETS", "24 32 40").split():
        q = s.with_knobs(MODEL=".bench/qwen3-30b-a3b", BUDGET=f"{budget}GiB", BENCH_FLAGS=flags)
        for policy in ["default", *s.knob("FIXED", "fixed64 fixed80 fixed96").split()]:
            # a process each: a second engine in one process hit a cuBLAS error
            name = f"qwen3-{budget}g-{policy}-r{q.rate}"
            failed |= policies(q, name, q.stream, ranking_path(q), skew_flags(q), [policy])
    return failed


FLA_TARGET = "/tmp/fla"  # flash-linear-attention installed here from the carried wheels (.bench/fla/*.whl)


def with_fla(s: Session) -> Session:
    """This session with flash-linear-attention importable: the hybrid's prompt chunks through its delta rule. The
    wheels (flash_linear_attention, fla_core, einops) are carried in .bench/fla; without them the reference runs."""
    s.run(["bash", "-c", f"ls .bench/fla/*.whl >/dev/null 2>&1 && python -m pip install -q --no-deps --no-index "
                         f"--target {FLA_TARGET} .bench/fla/*.whl"])  # fmt: skip
    return s.with_knobs(PYTHONPATH=f"{FLA_TARGET}:{s.env.get('PYTHONPATH', '')}")


def hybrid35(s: Session) -> int:
    """Qwen3.5-35B-A3B (.bench/qwen3.5-35b-a3b): at BUDGET (48 GiB, where its weights do not fit) LOW_POLICIES (no
    policy flags beside fixed64 fixed128 fixed192 of its 256 experts a layer), then at 80 GiB HIGH_POLICIES
    (resident beside the default); "-" runs none. A process each, TIME_LIMIT_S (120) a run."""
    s = with_fla(s)
    flags = f"--time-limit-s {s.knob('TIME_LIMIT_S', '120')} {s.knob('BENCH_FLAGS')}"
    runs = [(s.knob("BUDGET", "48GiB"), s.knob("LOW_POLICIES", "default fixed64 fixed128 fixed192")),
            ("80GiB", s.knob("HIGH_POLICIES", "resident default"))]  # fmt: skip
    failed = 0
    for budget, names in runs:
        q = s.with_knobs(MODEL=s.knob("MODEL", ".bench/qwen3.5-35b-a3b"), BUDGET=budget, BENCH_FLAGS=flags)
        for policy in names.replace("-", "").split():
            name = f"qwen3.5-{budget.removesuffix('GiB')}g-{policy}-r{q.rate}"
            failed |= policies(q, name, q.stream, ranking_path(q), skew_flags(q), [policy])
    return failed


def shift(s: Session) -> int:
    """The distribution-shift run of the cost-aware adjuster: dummy weights with two router regimes, the ranking
    profiled on the first half; fixed8, elastic8 and cost8 (whose swaps follow the shift)."""
    shifted, config = ".bench/stream-shift.jsonl", Path(s.model, "config.json")
    vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else f"<vocab_size of {config}>"
    s.run(s.tool("tools.engine.shift_stream", s.stream, "--vocab-size", vocab), log=Path(shifted), stderr="pass")
    skew = f"{skew_flags(s)} --router-regimes 2"
    return policies(s, f"shift-r{s.rate}", shifted, "/tmp/ranking-first-half.json", skew, ["fixed8", "elastic8", "cost8"])
