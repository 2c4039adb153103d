"""Programmatic dependent launch (PDL, sm_90 and later) for the MoE op's chain of kernels.

The op is a chain of small dependent launches (sort, gate/up GEMM, down GEMM, top-k sum): inside a CUDA graph each
boundary still costs the next grid's launch after the last program of the one before it has drained. With PDL a
kernel is launched while the one before it runs: its programs start, tell the driver the kernel after them may
launch too (`griddepcontrol.launch_dependents`) and wait (`griddepcontrol.wait`) for the whole grid before them to
finish and its writes to be visible, before they read or write anything. So a kernel's work never overlaps the one
before it, only its launch does, and the values are the ones without PDL. Every kernel of the chain waits first,
so each finished grid implies every grid before it finished: a kernel may read what any earlier one wrote.

Off unless a tuned config says `PDL` (`rimuru.ops.configs`), and only on a CUDA device of compute capability 9 or
more with a Triton that has the launch option; elsewhere (the interpreter included) the kernels compile without the
two instructions.
"""

import functools

import torch
import triton
import triton.language as tl

try:  # a Triton without the launch option (older than 3.3) launches every kernel plainly
    from triton.backends.nvidia.compiler import CUDAOptions

    TRITON_LAUNCHES_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # pragma: no cover - no NVIDIA backend
    TRITON_LAUNCHES_PDL = False


@triton.jit
def wait_for_prior_grid(USE_PDL: tl.constexpr):
    """A chained kernel's first statement: let the next kernel launch, then wait for the grid before this one."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched dependent: CUDA, sm_90 or later, a Triton with the option."""
    device = torch.device(device)
    if device.type != "cuda" or not TRITON_LAUNCHES_PDL:
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def launch_options(pdl: bool) -> dict:
    """The launch keywords for a chained kernel (none when off, so an older Triton never sees the option)."""
    return {"launch_pdl": True} if pdl else {}
