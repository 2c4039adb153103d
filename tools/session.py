"""`Session`: how a GPU job (tools/scenarios.py) runs its steps on the device, or only prints them (`dry_run`).

Owns the environment the jobs read (their knobs: `MODEL`, `BUDGET`, ... with the same defaults the shell jobs had),
the folder results go to (`$OUT`) and the running of commands: a log file, a time limit, what of the output to show.
It does not know any job; the table does.
"""

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tail(n: int) -> Callable[[str], str]:
    return lambda text: "\n".join(text.splitlines()[-n:])


def head(n: int) -> Callable[[str], str]:
    return lambda text: "\n".join(text.splitlines()[:n])


def grep_after(prefix: str, after: int) -> Callable[[str], str]:
    """The lines starting with `prefix` and the `after` lines below each (`grep -A`)."""

    def show(text: str) -> str:
        lines, keep = text.splitlines(), set()
        for i, line in enumerate(lines):
            if line.startswith(prefix):
                keep.update(range(i, min(i + after + 1, len(lines))))
        return "\n".join(lines[i] for i in sorted(keep))

    return show


def first_line(path: Path, word: str) -> str:
    """The first line of `path` holding `word` (`grep -m1`), or ""."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return next((line.rstrip("\n") for line in f if word in line), "")
    return ""


class Session:
    """One device call's jobs: the knobs they read, `$OUT`, and whether steps run or are only printed."""

    def __init__(self, env: dict[str, str], dry_run: bool = False):
        self.env, self.dry_run = dict(env), dry_run
        # NOTE: tools run as `python -P -m tools...`: -P keeps the checkout's own `rimuru/` (without ops/) from
        # shadowing the package tools/device_env.sh lays out in /tmp/pkg, so the checkout must be on PYTHONPATH
        paths = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(ROOT) not in paths and os.getcwd() not in paths:
            self.env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
        self.out = Path(self.knob("OUT", "/tmp/out"))

    def knob(self, name: str, default: str = "") -> str:
        """An environment knob as the shell read it (`${NAME:-default}`: empty counts as unset)."""
        return self.env.get(name) or default

    def with_knobs(self, **knobs: str) -> "Session":
        """This session with some knobs set, for one job (qwen3's own MODEL and BUDGET)."""
        session = Session(self.env | knobs, self.dry_run)
        session.out = self.out
        return session

    @property
    def model(self) -> str:
        return self.knob("MODEL", ".bench/qwen1.5-moe-a2.7b")

    @property
    def stream(self) -> str:
        return self.knob("STREAM", ".bench/stream-200-r0.jsonl")

    @property
    def rate(self) -> str:
        return self.knob("RATE", "0")

    @property
    def budget(self) -> str:
        return self.knob("BUDGET", "30GiB")

    @property
    def dummy(self) -> list[str]:
        """`--load-format dummy` unless MODEL holds weights (the carried .bench folders hold a config only)."""
        weights = ("model.safetensors", "model.safetensors.index.json")
        return [] if any(Path(self.model, name).exists() for name in weights) else ["--load-format", "dummy"]

    def tool(self, module: str, *args) -> list[str]:
        return ["python", "-P", "-m", module, *map(str, args)]

    def say(self, text: str) -> None:
        if text:
            print(text, flush=True)

    def run(self, argv: list, log: Path | None = None, timeout_s: int | None = None, stderr: str = "merge",
            show: Callable[[str], str] | None = None) -> int:  # fmt: skip
        """Run `argv` and return its exit status (124 past `timeout_s`, as `timeout` has it). Its output goes to
        `log` (stderr with it, "pass"ed through or "drop"ped), else to ours; `show` picks what of it to print after
        (with no log, the output is held for it)."""
        argv = [str(a) for a in argv]
        if self.dry_run:
            self.say(self._shell_line(argv, log, timeout_s, stderr))
            return 0
        run = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
        err = {"merge": subprocess.STDOUT, "pass": None, "drop": subprocess.DEVNULL}[stderr]
        with open(log, "w") if log else contextlib.nullcontext() as f:
            out = f if log else (subprocess.PIPE if show else None)
            try:
                done = subprocess.run(run, stdout=out, stderr=err, env=self.env, timeout=timeout_s, text=True)
                rc, text = done.returncode, done.stdout
            except subprocess.TimeoutExpired as expired:
                rc, text = 124, expired.stdout if isinstance(expired.stdout, str) else ""
        if show:
            self.say(show(Path(log).read_text(errors="replace") if log else text or ""))
        return rc

    def shell(self, script: str) -> int:
        """A pipeline, in bash (the Triton cache's tar | split)."""
        return self.run(["bash", "-c", script])

    def do(self, what: str, action: Callable[[], object]) -> None:
        """A step in Python (copy, summarise): `what` says it under a dry run."""
        if self.dry_run:
            self.say(f"# {what}")
        else:
            action()

    def show_file(self, path: Path, show: Callable[[str], str] = lambda text: text) -> None:
        """Print `show` of a file a step wrote (`tail`, `grep`); a missing file is said, not raised."""

        def read() -> None:
            try:
                self.say(show(Path(path).read_text(errors="replace")))
            except OSError as error:
                self.say(f"{path}: {error.strerror}")

        self.do(f"show {path}", read)

    @contextlib.contextmanager
    def clocks(self, path: Path) -> Iterator[None]:
        """SM and memory clocks, power and temperature every 0.5 s into `path` while the block runs (nothing
        without nvidia-smi): does the first run in a process run faster because the GPU is cool?"""
        query = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
        argv = ["nvidia-smi", f"--query-gpu={query}", "--format=csv", "-lms", "500"]
        if self.dry_run:
            self.say(f"{shlex.join(argv)} > {path} 2>&1 &  # until the block ends")
        logger = None
        if not self.dry_run and shutil.which("nvidia-smi"):
            with open(path, "w") as f:
                logger = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            if logger:
                logger.kill()
                logger.wait()

    @contextlib.contextmanager
    def server(self, argv: list, log: Path, health_url: str, wait_s: int) -> Iterator[None]:
        """`argv` in the background while the block runs, once `health_url` answers (or `wait_s` passed)."""
        argv = [str(a) for a in argv]
        if self.dry_run:
            self.say(f"{self._shell_line(argv, log, None, 'merge')} &  # until {health_url} answers, then the block")
            yield
            return
        with open(log, "w") as f:
            process = subprocess.Popen([sys.executable, *argv[1:]], stdout=f, stderr=subprocess.STDOUT, env=self.env)
        try:
            for _ in range(wait_s):
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(health_url, timeout=2).close()
                    break
                time.sleep(1)
            yield
        finally:
            process.terminate()
            process.wait()

    @staticmethod
    def _shell_line(argv: list[str], log: Path | None, timeout_s: int | None, stderr: str) -> str:
        line = shlex.join(argv) if timeout_s is None else f"timeout {timeout_s} {shlex.join(argv)}"
        err = {"merge": " 2>&1", "pass": "", "drop": " 2>/dev/null"}[stderr]
        return f"{line} > {log}{err}" if log else line + (" 2>/dev/null" if stderr == "drop" else "")
