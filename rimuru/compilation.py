"""`torch.compile` of the engine's forward pass (`EngineConfig.compile`): inductor over the model code between the
`rimuru::` custom ops, which stay opaque kernels; the CUDA graphs then capture the compiled pass.

`compile_forward` swaps the model's `forward` on the instance for a `CompiledForward`, so every caller (the model
runner, the step graphs' warm-ups and captures, the memory profile) runs the compiled pass. Dynamo compiles at the
first call of each shape (the memory profile and the graphs' warm-ups at start-up), dynamic in the token count once
a second count arrives; the routing hook that copy-mode expert reads need is the pass's one graph break a MoE layer
(`rimuru.models.pieces.call_routing_hook`). Inductor's caches sit under `cache_dir()`, so a later start loads what an
earlier one compiled. A compile that fails leaves the eager pass in place, with one warning.
"""

import logging
import os
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config

logger = logging.getLogger(__name__)

BACKEND = "inductor"
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,)  # BackendCompilerFailed, Unsupported, ... (not OOM)


def cache_dir() -> Path:
    """Inductor's cache: $TORCHINDUCTOR_CACHE_DIR, else beside Triton's ($TRITON_CACHE_DIR/../inductor), else
    ~/.cache/rimuru/inductor."""
    if chosen := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(chosen)
    if triton := os.environ.get("TRITON_CACHE_DIR"):
        return Path(triton).parent / "inductor"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rimuru" / "inductor"


class CompiledForward:
    """The model's forward, compiled; the eager one after a compile error (said once)."""

    def __init__(self, eager, num_layers: int):
        self.eager = eager  # the model's bound forward
        self.compiled = torch.compile(eager, backend=BACKEND)
        self.failed = False
        self.num_calls = 0
        # fused bf16 ops round each intermediate as eager does (reductions still sum in inductor's order)
        torch._inductor.config.emulate_precision_casts = True
        # each layer's frame after a routing hook's graph break compiles once a layer: room for every layer four
        # times (a fixed and a dynamic token count, each with a hook and without), before dynamo would give up and
        # run the rest eagerly
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 4 * num_layers + 8)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * num_layers)

    def __call__(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        if self.failed:
            return self.eager(input_ids, ctx)
        start = time.perf_counter()
        try:
            out = self.compiled(input_ids, ctx)
        except COMPILE_ERRORS as error:
            self.failed = True
            logger.warning("torch.compile failed (%s); the forward pass runs eagerly (--no-compile skips the attempt)",
                           _cause(error))  # fmt: skip
            logger.debug("torch.compile's error", exc_info=error)
            return self.eager(input_ids, ctx)
        self.num_calls += 1
        if self.num_calls == 1:
            logger.info("compiled the forward pass in %.1f s (inductor's cache: %s)", time.perf_counter() - start,
                        cache_dir())  # fmt: skip
        return out


def _cause(error: BaseException) -> str:
    """The root error's type and first line: dynamo wraps the backend's error in its own."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def compile_forward(model: torch.nn.Module, num_layers: int) -> CompiledForward:
    """Swap `model.forward` for its compiled form (the first calls compile: a progress line says so)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
    logger.info("compiling the forward pass with torch.compile at its first shapes (a first start takes a while)")
    forward = CompiledForward(model.forward, num_layers)
    model.forward = forward
    return forward
