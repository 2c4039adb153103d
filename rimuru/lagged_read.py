"""`LaggedRead`: a device tensor read on the host one call late, so that reading it never waits for a pass.

Under async scheduling the engine observes a round while the next pass is already queued: a plain `.cpu()` of a
tensor that pass adds to waits for the whole pass, and the host then prepares the next round with the GPU idle.
Here each `take` copies the tensor to pinned host memory behind the work queued so far and returns the copy the
call before made, which the passes before it have long finished. The reader sees values one call old.
"""

import torch


class LaggedRead:
    def __init__(self, source: torch.Tensor, zero_after_copy: bool = False):
        self.source = source
        self.zero_after_copy = zero_after_copy  # a count read as increments: each copy takes what came since the last
        on_gpu = source.device.type == "cuda"
        self._host = torch.empty(source.shape, dtype=source.dtype, pin_memory=on_gpu)
        self._copied = torch.cuda.Event() if on_gpu else None
        self._issued = False

    def take(self) -> torch.Tensor | None:
        """The copy the last call issued (None at the first call), then the next copy issued behind the queued
        work."""
        landed = None
        if self._issued:
            if self._copied is not None:
                self._copied.synchronize()  # issued a round or more ago: its passes are done
            landed = self._host.clone()
        self._host.copy_(self.source, non_blocking=True)
        if self.zero_after_copy:
            self.source.zero_()
        if self._copied is not None:
            self._copied.record()
        self._issued = True
        return landed
