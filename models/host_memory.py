"""Pinned host tensors of exactly their size, for the expert store.

torch's pinned allocator rounds every block up to a power of two, so a layer's 400 MB expert matrices would pin
512 MiB each (a third more host RAM than the weights). Here the memory is an anonymous mapping of the exact size,
registered with CUDA (page-locked and mapped for the GPU's direct reads) and unregistered before it is unmapped.
"""

import mmap
import weakref

import torch


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in page-locked memory of exactly its size; pageable where CUDA is absent."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not torch.cuda.is_available() or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    view = memoryview(buffer)
    tensor = torch.frombuffer(view, dtype=dtype, count=numel).view(shape)  # the storage keeps `view` alive
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if error != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed ({error})")
    # when the last storage is gone: the finalizer holds the mapping, so it is unregistered before it is unmapped
    weakref.finalize(view, _unregister_then_unmap, tensor.data_ptr(), buffer).atexit = False
    return tensor


def _unregister_then_unmap(address: int, buffer: mmap.mmap) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
    buffer.close()
