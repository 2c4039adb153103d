"""The `vsvllm` GPU job: vLLM 0.26 and Rimuru (all experts resident, and the default policy) on the same config,
budget and streams in one call (docs/benchmarks/vs-vllm.md).

vLLM's parts must be in /tmp/parts (see ../shared/peers/vllm/README.md: one call a part, carrying
.peers/vllm/vllm.part-0N); carry .peers/vllm/bin and .bench. Knobs: VS_STREAMS (default the 400 at 10/s and 200 at
once streams), VS_POLICIES ("resident default"), ORDER=rimuru-first to run Rimuru first, CALL names the call in
vs-vllm.json (default the commit). VS_VLLM_RECORDS=DIR takes vLLM's records of an earlier call from DIR (carried)
instead of running it again (/tmp/vllm-last holds the last call's while the machine stays warm); VS_VLLM=off runs
Rimuru alone (its rows against an earlier call's vLLM, by hand). Records, logs and
the merged table in $OUT. VS_TP=N splits both engines over N GPUs (tensor parallelism; BUDGET is per GPU). VS_SKEW=S first writes MODEL's random weights at router skew S as a checkpoint
(tools/vs_vllm/checkpoint.py, under /tmp/vs-checkpoints/<model>-skew<S>) and both engines load it: the same weights,
routing that leaves cold experts cold, which vLLM's own dummy weights never do.
"""

import json
import re
import shutil
from collections import Counter
from pathlib import Path

from tools.session import Session, first_line
from tools.sweeps import policy_spec
from tools.vs_vllm.vllm_memory import vllm_memory

STREAMS = ".bench/stream-400-r10.jsonl .bench/stream-200-r0.jsonl"
LAST = Path("/tmp/vllm-last")  # the last call's vLLM records, VS_VLLM_RECORDS for a later call
VSITE_ENV = Path("/tmp/vsite/env.sh")  # written by .peers/vllm/install.sh: vLLM's site folder on PYTHONPATH


CHECKPOINTS = Path("/tmp/vs-checkpoints")


def vsvllm(s: Session) -> int:
    folder = s.out / "vs"
    if skew := s.knob("VS_SKEW"):
        s = with_skewed_checkpoint(s, skew)
    streams = s.knob("VS_STREAMS", STREAMS).split()
    names = s.knob("VS_POLICIES", "resident default").split()
    try:
        runs = [arg for stream in streams for name in names for arg in ("--run", rimuru_run(name, stream))]
    except ValueError as error:  # an unknown policy name
        s.say(str(error))
        return 1
    s.do(f"mkdir -p {folder}", lambda: folder.mkdir(parents=True, exist_ok=True))
    with_vllm = s.knob("VS_VLLM", "on") != "off"
    if with_vllm and not s.knob("VS_VLLM_RECORDS") and not VSITE_ENV.is_file():
        install = folder / "vllm-install.log"
        if s.run(["bash", ".peers/vllm/install.sh", ".peers/vllm/bin"], log=install) != 0:
            s.show_file(install, lambda text: "\n".join(text.splitlines()[-5:]))
            return 1
    steps = [lambda: run_vllm(s, folder, streams), lambda: run_rimuru(s, folder, runs)][0 if with_vllm else 1 :]
    for step in steps[::-1] if s.knob("ORDER", "vllm-first") == "rimuru-first" else steps:
        step()
    merge(s, folder, streams, names, with_vllm)
    return 0


def with_skewed_checkpoint(s: Session, skew: str) -> Session:
    """This session with MODEL the checkpoint of MODEL's random weights at router `skew`, written once a machine."""
    target = CHECKPOINTS / f"{Path(s.model).name}-skew{skew}"
    if not (target / "model.safetensors.index.json").is_file():
        s.run(s.tool("tools.vs_vllm.checkpoint", s.model, "--out", target, "--router-skew", skew),
              log=s.out / f"checkpoint-{target.name}.log", show=lambda text: text.splitlines()[-1] if text else "")  # fmt: skip
    return s.with_knobs(MODEL=str(target))


def stem(stream: str) -> str:
    return Path(stream).name.removesuffix(".jsonl")


def rimuru_run(name: str, stream: str) -> str:
    """`--run` of policy `name` on `stream`, labelled `name-<stream>`."""
    if name == "default":
        return f"default-{stem(stream)}=--stream {stream}"
    flags = policy_spec(name).removeprefix(f"{name}=")
    return f"{name}-{stem(stream)}={flags} --stream {stream}"


def run_vllm(s: Session, folder: Path, streams: list[str]) -> None:
    if records := s.knob("VS_VLLM_RECORDS"):
        s.do(f"cp {records}/vllm-*.json {folder}/", lambda: _copy(Path(records).glob("vllm-*.json"), folder))
        return
    # a script by path, as before vLLM's env: it imports vLLM only, and env.sh prepends vLLM's site to PYTHONPATH
    replay = ["python", "tools/vs_vllm/replay.py", s.model, "--budget-gib", s.budget.removesuffix("GiB"),
              "--tensor-parallel-size", s.knob("VS_TP", "1"), "--out-dir", str(folder),
              *(arg for stream in streams for arg in ("--stream", stream))]  # fmt: skip
    s.run(["bash", "-c", f'source {VSITE_ENV} && exec "$@"', "_", *replay], log=folder / "vllm.log")
    s.do("vLLM's memory, from its log, into its records", lambda: _record_vllm_memory(folder))
    s.do("print vLLM's throughput lines", lambda: _print_vllm(s, folder))
    s.do(f"cp {folder}/vllm-*.json {LAST}/ (VS_VLLM_RECORDS for a later call)", lambda: _keep_last(folder))


def _record_vllm_memory(folder: Path) -> None:
    """Each vLLM record of the call gets `memory`: what its start-up log says it holds (one start-up serves them all)."""
    log = folder / "vllm.log"
    memory = vllm_memory(log.read_text(errors="replace")) if log.is_file() else None
    for path in folder.glob("vllm-*.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(record | {"memory": memory}, indent=1))


def _print_vllm(s: Session, folder: Path) -> None:
    for record in sorted(folder.glob("vllm-*.json")):
        for line in record.read_text().splitlines():
            if "output_tokens_per_s" in line:
                s.say(line[:200])


def _copy(paths, folder: Path) -> None:
    for path in paths:
        shutil.copy(path, folder)


def _keep_last(folder: Path) -> None:
    shutil.rmtree(LAST, ignore_errors=True)
    LAST.mkdir(parents=True)
    _copy(folder.glob("vllm-*.json"), LAST)


def run_rimuru(s: Session, folder: Path, runs: list[str]) -> None:
    common = (f"--gpu-memory-budget {s.budget} --max-num-batched-tokens 2048 --quiet {' '.join(s.dummy)} "
              f"--tensor-parallel-size {s.knob('VS_TP', '1')} {s.knob('BENCH_FLAGS')}")  # fmt: skip
    s.run(s.tool("tools.engine.sweep", s.model, "--out-dir", folder, "--ranking", f"{s.model}/expert_ranking-vs.json",
                 "--common", common, *runs))  # fmt: skip


def merge(s: Session, folder: Path, streams: list[str], names: list[str], with_vllm: bool = True) -> None:
    """The records into $OUT/vs-vllm.json (docs/benchmarks/vs-vllm.json's runs and this call's) and its table, the
    engines' start-up lines counted, and the folder packed as $OUT/vs-records.tar.gz."""
    specs = []
    for stream in streams:
        specs += [f"vllm={folder}/vllm-{stem(stream)}.json"] if with_vllm else []
        specs += [f"{name}={folder}/{name}-{stem(stream)}.json" for name in names]
    s.run(["cp", "docs/benchmarks/vs-vllm.json", s.out / "vs-vllm.json"], stderr="drop")
    commit = s.knob("RIMURU_COMMIT", "unknown")
    table = s.out / "vs-vllm-table.md"
    s.run(s.tool("tools.vs_vllm.table", "--call", s.knob("CALL", commit), "--commit", commit, "--json",
                 s.out / "vs-vllm.json", "--table", table, *specs))  # fmt: skip
    s.show_file(table)
    s.do("count the logs' KV cache, profiled and weights lines", lambda: s.say(startup_lines(folder)))
    if s.run(["tar", "-czf", s.out / "vs-records.tar.gz", "-C", s.out, "vs"]) == 0:
        s.run(["rm", "-r", folder])


def startup_lines(folder: Path) -> str:
    """`grep -h "KV cache\\|profiled\\|weights .* GiB on" *.log | sort | uniq -c | head -20`."""
    pattern = re.compile(r"KV cache|profiled|weights .* GiB on")
    lines = [line for log in sorted(folder.glob("*.log")) for line in log.read_text(errors="replace").splitlines()
             if pattern.search(line)]  # fmt: skip
    counts = Counter(lines)
    return "\n".join(f"{counts[line]:7d} {line}" for line in sorted(counts)[:20])


def stepvs(s: Session) -> int:
    """The decode step of vLLM and of Rimuru (all experts resident) at each of STEP_BATCHES (1 16 64 256) requests,
    from the same stream, at STEP_BUDGET (120 GiB: room for every batch in both engines), every prompt cycled to
    STEP_CONTEXT tokens where given (a drain's long contexts); VS_SKEW as for vsvllm (one checkpoint both load, so
    both route alike); STEP_PROFILE=1 adds vLLM's kernel table a batch to its log (Rimuru's logs have theirs); vLLM's
    parts as for vsvllm. Lines "decode step, N running: X ms" of both; STEP_PROFILE also writes both engines' traces."""
    batches = s.knob("STEP_BATCHES", "1 16 64 256").split()
    if skew := s.knob("VS_SKEW"):
        s = with_skewed_checkpoint(s, skew)
    s = s.with_knobs(BUDGET=s.knob("STEP_BUDGET", "120GiB"))
    if not VSITE_ENV.is_file() and s.run(["bash", ".peers/vllm/install.sh", ".peers/vllm/bin"],
                                         log=s.out / "vllm-install.log") != 0:  # fmt: skip
        return 1
    context = ["--context", s.knob("STEP_CONTEXT")] if s.knob("STEP_CONTEXT") else []
    step = ["python", "tools/vs_vllm/decode_step.py", s.model, "--budget-gib", s.budget.removesuffix("GiB"),
            "--stream", s.stream, "--batch", *batches, *context, "--out", s.out / "vllm-decode-steps.json",
            *(["--profile"] if s.knob("STEP_PROFILE") else [])]  # fmt: skip
    s.run(["bash", "-c", f'source {VSITE_ENV} && exec "$@"', "_", *step], log=s.out / "vllm-decode-steps.txt",
          timeout_s=420, show=lambda text: "\n".join(x for x in text.splitlines() if x.startswith("decode step")))  # fmt: skip
    for batch in batches:
        log = s.out / f"rimuru-decode-step-{batch}.txt"
        s.run(s.tool("tools.engine.profile_step", s.model, *s.dummy, "--stream", s.stream, "--steps", "20",
                     "--num-requests", batch, "--expert-policy", "resident", "--gpu-memory-budget", s.budget,
                     *context, *(["--trace", s.out / f"rimuru-decode-trace-{batch}.json"] if s.knob("STEP_PROFILE") else [])),
              log=log, timeout_s=240)  # fmt: skip
        s.say(f"rimuru {first_line(log, 'decode step')}")
    return 0
