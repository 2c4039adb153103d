"""The GPU jobs of tools/scenarios.py that run one tool each: tests, kernel sweeps and tuning, profiles, the server.

Each job takes the call's `Session`, writes under `s.out` and prints the lines worth reading in the call's output.
The policy sweeps (`rimuru bench` runs by policy name) are in tools/sweeps.py.
"""

import shlex
from pathlib import Path

from tools.session import Session, first_line, grep_after, head, tail
from tools.sweeps import ranking_path, skew_flags, with_fla

PYTEST = ["python", "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append"]


def gputests(s: Session) -> None:
    """Every @pytest.mark.gpu test; GPUTESTS narrows it. flash-linear-attention from .bench/fla where carried."""
    s = with_fla(s)
    # -P and --import-mode=append: the repository's own `rimuru/` folder must not shadow the package in /tmp/pkg
    log = s.out / "gputests.log"
    s.run([*PYTEST, "--durations=15", "-m", "gpu", *s.knob("GPUTESTS", "tests/ops tests/models tests/engine").split()],
          log=log, show=tail(32))  # fmt: skip


def opsgpu(s: Session) -> None:
    """= GPUTESTS=tests/ops gputests, with its own log."""
    s.run([*PYTEST, "-m", "gpu", "tests/ops"], log=s.out / "opsgpu.log", timeout_s=300, show=tail(8))


def breakdown(s: Session) -> None:
    log = s.out / "breakdown.txt"
    rc = s.run(s.tool("tools.kernels.bench", "--breakdown", "--out", s.out / "breakdown.json"), log=log, timeout_s=300)
    s.say(f"rc={rc}")
    s.show_file(log, tail(14))


def decodesweep(s: Session) -> None:
    log = s.out / "decode_sweep.txt"
    rc = s.run(s.tool("tools.kernels.decode_attention", "--out", s.out / "decode_sweep.json"), log=log, timeout_s=300)
    s.say(f"rc={rc}")
    s.show_file(log, lambda text: tail(60)("\n".join(x for x in text.splitlines() if not x.startswith("  warn"))))


def _tune(s: Session, name: str, timeout_s: int, budget_s: int, args: list[str], shown: int) -> None:
    """$OUT/<GPU name>.json: the table this GPU uses now (its own, else its architecture's) with the buckets named
    retuned; copy it to ops/configs/ where the buckets improved."""
    s.run(s.tool("tools.kernels.tune", "--budget-s", budget_s, *args, "--out-dir", s.out),
          log=s.out / f"{name}.txt", timeout_s=timeout_s, show=tail(shown))  # fmt: skip


def tunesmall(s: Session) -> None:
    _tune(s, "tunesmall", 420, 360, ["--m", "1", "2", "4", "8", "16"], 6)


def tunelarge(s: Session) -> None:
    _tune(s, "tunelarge", 480, 420, ["--m", "512", "1024", "2048", "4096"], 10)


def tunewide(s: Session) -> None:
    """Qwen3's M = 1024 over the wider large-M space (`tools.kernels.tune.search_space`, wide)."""
    _tune(s, "tunewide", 480, 420, ["--models", "qwen3-30b-a3b", "--m", "1024", "--wide"], 4)


def anchors(s: Session) -> None:
    """Does the order, through the GPU's clocks, move the large-M op times? (kernels.md)"""
    with s.clocks(s.out / "anchors-gpu-clocks.csv"):
        for order in (["4096", "1024", "256", "64", "8", "1"], ["1", "8", "64", "256", "1024", "4096"]):
            name = f"anchors-from-{order[0]}"
            argv = s.tool("tools.kernels.bench", "--skip-attention", "--m", *order, "--out", s.out / f"{name}.json")
            rc = s.run(argv, log=s.out / f"{name}.txt", timeout_s=200)
            s.say(f"-- {name} rc={rc}")
            s.show_file(s.out / f"{name}.txt", grep_after("model M", 14))


def launch(s: Session) -> None:
    rc = s.run(s.tool("tools.kernels.launch", "--out", s.out / "launch.json"), log=s.out / "launch.txt", timeout_s=200)
    s.say(f"rc={rc}")
    s.show_file(s.out / "launch.txt", tail(20))


def kernels(s: Session) -> None:
    s.run(s.tool("tools.kernels.bench", "--skip-moe", "--out", s.out / "kernels_decode.json"),
          log=s.out / "kernels_decode.txt", show=tail(40))  # fmt: skip


def profile(s: Session) -> None:
    """PROFILE_FLAGS replaces the 200 resident requests (e.g. a fixed offload to profile the routing hook)."""
    flags = s.knob("PROFILE_FLAGS", "--num-requests 200 --expert-policy resident").split()
    trace = s.out / "step_trace.json"
    s.run(s.tool("tools.engine.profile_step", s.model, *s.dummy, "--stream", s.stream, "--steps", "20", *flags,
                 "--trace", trace), log=s.out / "profile_step.txt")  # fmt: skip
    s.run(["gzip", "-f", trace])  # several MB of JSON: the fetch limit is 16 MiB a file
    s.show_file(s.out / "profile_step.txt", head(40))


def linearstate(s: Session) -> None:
    """The linear layers' decode state update against the copy rate (tools/kernels/linear_state.py)."""
    s.run(s.tool("tools.kernels.linear_state", "--out", s.out / "linear_state.json"),
          log=s.out / "linear_state.txt", timeout_s=200, show=tail(6))  # fmt: skip


def stepab(s: Session) -> None:
    """The decode step at PROFILE_FLAGS (64 resident requests) in this tree and in BASE_TREE (.bench/base: `git
    archive BASE | tar -x -C .bench/base`, carried) at BASE_FLAGS (PROFILE_FLAGS), alternated this, base, this, base;
    each lays out its own package. BASE_TREE=. with BASE_FLAGS compares two settings of this tree (--compile);
    PROFILE_ENV and BASE_ENV ("VAR=value ...") set each side's environment (RIMURU_INDUCTOR_FUSIONS=1); ROUNDS (2)
    pairs."""
    base = s.knob("BASE_TREE", ".bench/base")
    flags = s.knob("PROFILE_FLAGS", "--num-requests 64 --expert-policy resident")
    this_side = ("this", ".", flags, s.knob("PROFILE_ENV"))
    base_side = ("base", base, s.knob("BASE_FLAGS", flags), s.knob("BASE_ENV"))
    model, stream = Path(s.model).resolve(), Path(s.stream).resolve()
    for i, (name, tree, tree_flags, env) in enumerate([this_side, base_side] * int(s.knob("ROUNDS", "2"))):
        log = s.out / f"stepab-{i}-{name}.txt"
        script = (f"cd {tree} && source tools/device_env.sh && exec env {env} python -P -m tools.engine.profile_step "
                  f"{model} {' '.join(s.dummy)} --stream {stream} --steps 20 {tree_flags}")  # fmt: skip
        rc = s.run(["bash", "-c", script], log=log, timeout_s=240)
        s.say(f"-- {name} rc={rc}: {first_line(log, 'decode step')}")


def attnprobe(s: Session) -> None:
    """tools/engine/attention_probe.py at PROFILE_FLAGS (16 resident requests at BUDGET)."""
    flags = s.knob("PROFILE_FLAGS", f"--num-requests 16 --expert-policy resident --gpu-memory-budget {s.budget}")
    log = s.out / "attention_probe.txt"
    s.run(s.tool("tools.engine.attention_probe", s.model, *s.dummy, "--stream", s.stream, *flags.split(),
                 "--out", s.out / "attention_probe.json"), log=log, timeout_s=240)  # fmt: skip
    s.show_file(log, lambda text: "\n".join(x for x in text.splitlines() if x.startswith(("attention", "Trace"))))


def hostphases(s: Session) -> None:
    """PROFILE_FLAGS (default --num-requests 1); the ranking at SKEW."""
    for adjuster in ("paper", "cost"):
        log = s.out / f"hostphases-{Path(s.model).name}-{adjuster}.txt"
        s.run(s.tool("tools.engine.profile_step", s.model, *s.dummy, "--stream", s.stream, "--steps", "100",
                     "--gpu-memory-budget", s.budget, "--expert-ranking", ranking_path(s), "--adjuster", adjuster,
                     "--max-num-seqs", "8", "--no-mixed-cuda-graphs", *skew_flags(s).split(),
                     *s.knob("PROFILE_FLAGS", "--num-requests 1").split()), log=log, timeout_s=150)  # fmt: skip
        s.say(f"-- {adjuster}")
        s.show_file(log, lambda text: head(14)("\n".join(x for x in text.splitlines()
                                                           if x.startswith(("decode step", "  ")))))  # fmt: skip


def throughput(s: Session) -> None:
    log = s.out / "throughput-whole.log"
    rc = s.run(s.tool("rimuru.serving.cli", "bench", s.model, "--stream", s.stream, "--rate", "0", "--expert-policy",
                      "resident", "--quiet", *s.dummy, "--out", s.out / "throughput-whole.json"),
               log=log, timeout_s=280)  # fmt: skip
    s.do("show the record's throughput", lambda: s.say(f"resident, whole GPU: rc={rc} {first_line(log, 'output_tokens_per_s')}"))


def serve(s: Session) -> None:
    """SERVE_STREAM (.bench/stream-100-r10.jsonl); the server's dependencies from .whl when carried."""
    wheels = sorted(Path(".whl").glob("*.whl"))
    if Path(".whl").is_dir():
        s.run(["python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--upgrade", "--target", "/tmp/site", *wheels])  # fmt: skip
        s.env["PYTHONPATH"] = f"{s.env.get('PYTHONPATH', '')}:/tmp/site"  # the rest of the call sees them too
    server = s.tool("rimuru.serving.cli", "serve", s.model, *s.dummy, "--port", "8000")
    with s.server(server, s.out / "server.log", "http://localhost:8000/health", wait_s=180):
        s.run(s.tool("tools.serving.bench", "--stream", s.knob("SERVE_STREAM", ".bench/stream-100-r10.jsonl"),
                     "--out", s.out / "serving-h200.json"), timeout_s=300, show=tail(12))  # fmt: skip


def memory(s: Session) -> None:
    """The activation reserve against measured peaks: resident (decode graphs) and elastic (mixed graphs too);
    MEMORY_POLICIES="fixed" MEMORY_FLAGS="--offload-per-layer 16" measures others."""
    for policy in s.knob("MEMORY_POLICIES", "resident elastic").split():
        s.say(f"-- {policy}")
        s.run(s.tool("tools.engine.memory", s.model, *s.dummy, "--gpu-memory-budget", s.budget,
                     "--max-num-batched-tokens", "2048", "--expert-policy", policy, *s.knob("MEMORY_FLAGS").split(),
                     "--out", s.out / f"memory-{policy}.json"), timeout_s=240, show=tail(6))  # fmt: skip


def hook(s: Session) -> None:
    """No graphs captured: the hook runs outside them anyway."""
    s.run(s.tool("tools.engine.hook", s.model, *s.dummy, *skew_flags(s).split(), "--gpu-memory-budget", s.budget,
                 "--expert-policy", "fixed", "--offload-per-layer", "8", "--no-cuda-graphs", "--tokens", "1", "8",
                 "64", "256", "--out", s.out / "hook.json"), timeout_s=200, show=tail(6))  # fmt: skip


def scheduler(s: Session) -> None:
    """Given .bench/kv_cache_before.py (`git show b2a86f2:rimuru/kv_cache.py`: a copy at each page allocation) and
    .bench/model_runner_before.py (`git show 0d983eb:rimuru/model_runner.py`), their rounds alternated with these."""
    against = ["--against", ".bench/kv_cache_before.py"] if Path(".bench/kv_cache_before.py").is_file() else []
    if Path(".bench/model_runner_before.py").is_file():
        against += ["--against-runner", ".bench/model_runner_before.py"]
    s.run(s.tool("tools.engine.scheduler", "--device", "cuda", *against), log=s.out / "scheduler.json",
          stderr="pass", show=lambda text: text)  # fmt: skip


def sampler(s: Session) -> None:
    """Given .bench/sampler_before.py (`git show bc32907:rimuru/sampler.py`: a few kernels a row), that one
    alternated with this one."""
    against = ["--against", ".bench/sampler_before.py"] if Path(".bench/sampler_before.py").is_file() else []
    s.run(s.tool("tools.engine.sampler", "--device", "cuda", *against), log=s.out / "sampler.json", stderr="drop",
          show=lambda text: text)  # fmt: skip


def cache(s: Session) -> None:
    """Last in a call: Triton's compiled kernels, to carry in .bench next time (tools/device_env.sh unpacks them)."""
    folder = s.knob("TRITON_CACHE_DIR", f"{Path.cwd()}/.triton-cache")
    if not Path(folder).is_dir() and not s.dry_run:
        s.say(f"no Triton cache at {folder}")
        return
    # NOTE: in parts of 15 MB: one file over 16 MiB does not come back
    parts = f"{s.out}/triton-cache.tar.gz.part-"
    s.shell(f"tar -czf - -C {shlex.quote(folder)} . | split -b 15M - {shlex.quote(parts)} && du -ch {shlex.quote(parts)}*")
