"""Runs `interp_engine.py` (the engine on the GPU kernels, under the Triton interpreter) in a subprocess
(`tests/interpreter.py` says why), started in the background when the session's tests are collected."""

from pathlib import Path

import pytest

from tests.interpreter import pytest_under_interpreter

MODULE = Path(__file__).parent / "interp_engine.py"


@pytest.mark.background(MODULE)
def test_engine_on_gpu_kernels_under_triton_interpreter():
    pytest_under_interpreter(MODULE)
