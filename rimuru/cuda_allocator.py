"""The CUDA caching allocator's settings the engine runs under.

Prefill and mixed steps that run eagerly allocate activations whose sizes change every step. Under the default
allocator each freed block is split for the next request of another size, so reserved memory drifts above what is
allocated. At skew 0.5, `fixed16` reserved 30.35 GiB of a 30 GiB budget while 28.96 GiB was allocated
(`docs/benchmarks/paper-scenario.md`, "The allocator"). Expandable segments map physical pages into one growing
segment a stream instead, so freed memory serves a request of any size: 29.12 GiB reserved in the same run.
"""

import logging
import os

import torch

logger = logging.getLogger("rimuru")

# a user who configures the allocator keeps exactly what they asked for
USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(device: torch.device) -> bool:
    """Make the segments the allocator creates from now on expandable (call it before the engine's first CUDA
    allocation), unless the device is not CUDA or the user set the allocator's settings. Whether it did."""
    if device.type != "cuda" or any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    apply_settings(EXPANDABLE_SEGMENTS)
    logger.debug("CUDA allocator: %s", EXPANDABLE_SEGMENTS)
    return True


def apply_settings(settings: str) -> None:
    """The allocator's runtime setter: torch._C's since torch 2.10 deprecated the `torch.cuda.memory` one."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings  # how PyTorch's own tests turn expandable segments on
    setter(settings)
