"""The engine turns on expandable segments for CUDA, and leaves a user's own allocator settings alone."""

import pytest
import torch

from rimuru import cuda_allocator
from rimuru.cuda_allocator import EXPANDABLE_SEGMENTS, USER_SETTINGS, use_expandable_segments


@pytest.fixture
def applied(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_allocator, "apply_settings", calls.append)
    for name in USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_cuda_gets_expandable_segments(applied):
    assert use_expandable_segments(torch.device("cuda", 0))
    assert applied == [EXPANDABLE_SEGMENTS]


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_a_users_allocator_settings_stand(applied, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:512")
    assert not use_expandable_segments(torch.device("cuda"))
    assert applied == []


def test_cpu_changes_nothing(applied):
    assert not use_expandable_segments(torch.device("cpu"))
    assert applied == []


def test_the_setter_exists_in_this_torch():
    assert callable(getattr(torch._C, "_accelerator_setAllocatorSettings", None)) or callable(
        getattr(torch.cuda.memory, "_set_allocator_settings", None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_allocates_expandable_segments(family, monkeypatch):
    from rimuru.config import EngineConfig
    from rimuru.engine import Engine

    for name in USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    folder, _, _ = family
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype=torch.float32, cuda_graphs=False))
    try:
        segments = torch.cuda.memory_snapshot()
        assert segments and any(segment.get("is_expandable") for segment in segments)
    finally:
        engine.close()
