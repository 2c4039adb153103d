"""Runs `interp_kernels.py` (`ref` vs `tri` for every kernel) under the Triton interpreter in a subprocess.

TRITON_INTERPRET is read when `@triton.jit` runs, i.e. when `rimuru.ops` is first imported; any earlier test
folder may already have imported it, and setting the variable here would leak into later ones. A child process
with the variable set gets fresh, interpreted kernels and leaves this process alone.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interp_kernels.py")]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
