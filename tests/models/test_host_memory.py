"""The exact-size pinned host tensors: registered once at their size, unregistered only when the last view is gone."""

import gc
import mmap
import types

import torch

from rimuru.models import host_memory


class _FakeCudart:
    cudaError = types.SimpleNamespace(success=0)

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        EVENTS.append("unregister")
        return 0


EVENTS: list[str] = []


class _LoggedMapping(mmap.mmap):
    """An anonymous mapping that logs when it is unmapped: by close(), or by its deallocation right after __del__."""

    def close(self):
        if not self.closed:
            EVENTS.append("unmap")
        super().close()

    def __del__(self):
        if not self.closed:
            EVENTS.append("unmap")


def test_pinned_empty_registers_its_exact_size_until_the_last_view_dies(monkeypatch):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    tensor = host_memory.pinned_empty((3, 5, 7), torch.bfloat16)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.bfloat16
    assert cudart.registered == {tensor.data_ptr(): 3 * 5 * 7 * 2}  # no rounding up
    tensor.fill_(1.5)
    view, ptr = tensor[2], tensor.data_ptr()
    del tensor
    gc.collect()
    assert cudart.unregistered == [] and view.sum().item() == 1.5 * 35  # a view keeps the memory registered
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_pinned_empty_without_cuda_is_a_plain_tensor():
    if torch.cuda.is_available():
        return
    tensor = host_memory.pinned_empty((2, 3), torch.float32)
    assert tensor.shape == (2, 3) and not tensor.is_pinned()


def test_pinned_memory_is_unregistered_before_it_is_unmapped(monkeypatch):
    """CUDA wants a registered range unregistered while it is still mapped (an mmap's own deallocation unmaps before
    its weak references' callbacks run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", _FakeCudart)
    monkeypatch.setattr(host_memory.mmap, "mmap", _LoggedMapping)
    EVENTS.clear()
    tensor = host_memory.pinned_empty((4, 8), torch.float32)
    del tensor
    gc.collect()
    assert EVENTS == ["unregister", "unmap"]
