"""A test module run by pytest in a child process under the Triton interpreter.

TRITON_INTERPRET is read when `@triton.jit` runs, i.e. when `rimuru.ops` is first imported; any earlier test
folder may already have imported it, and setting the variable here would leak into later ones. A child process
with the variable set gets fresh, interpreted kernels and leaves this process alone.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def workers() -> list[str]:
    """pytest-xdist's flag for one worker a core: the interpreter runs a kernel on one core while the parent only
    waits. Not for the engine's module: its few tests use torch's threads, and two of them at once run slower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ["-n", str(cores)] if cores > 1 else []


def pytest_under_interpreter(module: Path, parallel: bool = False) -> None:
    """Run `module`'s tests with TRITON_INTERPRET=1, across the cores if `parallel`; every one must pass, none skip."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # -P: the repository root must not come first on sys.path, or its `rimuru/` folder (without ops/) shadows the
    # package laid out on PYTHONPATH and an editable install elsewhere supplies `rimuru.ops` instead
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *(workers() if parallel else []),
           str(module)]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
