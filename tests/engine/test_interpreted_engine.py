"""Runs `interp_engine.py` (the engine on the GPU kernels, under the Triton interpreter) in a subprocess
(`tests/interpreter.py` says why)."""

from pathlib import Path

from tests.interpreter import pytest_under_interpreter


def test_engine_on_gpu_kernels_under_triton_interpreter():
    pytest_under_interpreter(Path(__file__).parent / "interp_engine.py")
