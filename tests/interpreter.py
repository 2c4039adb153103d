"""A test module run by pytest in a child process under the Triton interpreter.

TRITON_INTERPRET is read when `@triton.jit` runs, i.e. when `rimuru.ops` is first imported; any earlier test
folder may already have imported it, and setting the variable here would leak into later ones. A child process
with the variable set gets fresh, interpreted kernels and leaves this process alone.

A serial child starts when the session's tests are collected (`tests/conftest.py`) and its test waits for it: the
interpreter runs on one core, and the rest of the suite leaves about one of two idle.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
TIMEOUT_S = 900
_started: dict[Path, "Child"] = {}


def workers() -> list[str]:
    """pytest-xdist's flag for one worker a core: the interpreter runs a kernel on one core while the parent only
    waits. Not for the engine's module: its few tests use torch's threads, and two of them at once run slower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ["-n", str(cores)] if cores > 1 else []


class Child:
    """pytest of one module under the interpreter, running; its output in a temporary file (a pipe could fill)."""

    def __init__(self, module: Path, parallel: bool):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        if not parallel:  # one thread: started in the background, it leaves the suite the other core
            env["OMP_NUM_THREADS"] = "1"
        # -P: the repository root must not come first on sys.path, or its `rimuru/` folder (without ops/) shadows the
        # package laid out on PYTHONPATH and an editable install elsewhere supplies `rimuru.ops` instead
        cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *(workers() if parallel else []),
               str(module)]  # fmt: skip
        self.output = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.output, stderr=subprocess.STDOUT,
                                        text=True)  # fmt: skip

    def wait(self) -> tuple[int, str]:
        """(exit status, output) once the child ends."""
        try:
            code = self.process.wait(timeout=TIMEOUT_S)
        finally:
            self.process.kill()
        with self.output:
            self.output.seek(0)
            return code, self.output.read()


def start_in_background(module: Path) -> None:
    """Start `module`'s serial run now; `pytest_under_interpreter(module)` then waits for it."""
    if module.resolve() not in _started:  # a module collected twice still runs once
        _started[module.resolve()] = Child(module, parallel=False)


def stop_background() -> None:
    """End any child whose test did not run (a deselection, -x)."""
    while _started:
        _started.popitem()[1].process.kill()


def pytest_under_interpreter(module: Path, parallel: bool = False) -> None:
    """Run `module`'s tests with TRITON_INTERPRET=1, across the cores if `parallel`; every one must pass, none skip."""
    child = _started.pop(module.resolve(), None) or Child(module, parallel)
    code, output = child.wait()
    assert code == 0, output[-12000:]
    assert " passed" in output and "skipped" not in output.splitlines()[-1], output[-2000:]
