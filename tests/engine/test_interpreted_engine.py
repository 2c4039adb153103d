"""Runs `interp_engine.py` (the engine on the GPU kernels, under the Triton interpreter) in a subprocess: the
variable is read when `rimuru.ops` is first imported, and a child process keeps it out of other tests."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_engine_on_gpu_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interp_engine.py")]
    done = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
