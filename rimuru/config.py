"""`EngineConfig`: every engine option in one frozen dataclass, and `resolve()` for the values derived from the
model and the machine. Components receive only the few fields they need, never this whole object.
"""

from __future__ import annotations

import io
import math
import os
import re
import tokenize
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_TOKENS = 16  # tokens a KV page holds, lowered where the expert page cannot carry them

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | float | str | None) -> int | None:
    """'30GiB', '30 GB', '2.5e9' or a number of bytes -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"gpu_memory_budget must be bytes or a size such as '30GiB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num_bytes: int) -> str:
    """A size as a user would type it back into gpu_memory_budget, rounded up: '27.32GiB', '12.6MiB'."""
    if num_bytes >= 2**30:
        return f"{math.ceil(num_bytes / 2**30 * 100) / 100:.2f}GiB"
    return f"{math.ceil(num_bytes / 2**20 * 10) / 10:.1f}MiB"


def _check_device(device: str, budget: int | None) -> None:
    """ValueError for a device torch cannot use, or a budget that is not positive or exceeds the device's memory."""
    import torch  # here, not at the top: `rimuru --help` reads this module and should not wait for torch

    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} finds no CUDA device")
    if budget is None:
        return
    if budget <= 0:
        raise ValueError(f"gpu_memory_budget must be positive, got {budget} bytes")
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory if kind == "cuda" else host_memory()
    if budget > total:
        raise ValueError(f"gpu_memory_budget {budget / 2**30:.2f} GiB exceeds the {total / 2**30:.2f} GiB of "
                         f"{device}")  # fmt: skip


def host_memory(available: bool = False) -> int:
    """Bytes of host RAM: in total, or available now (`MemAvailable`, what a pinned expert store can take)."""
    if available:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CHOICES = {  # the string options and their values; the command line offers the same
    "load_format": ("auto", "dummy"),
    "expert_policy": ("resident", "fixed", "elastic"),
    "adjuster": ("cost", "paper"),
    "expert_reads": ("direct", "copy"),
    "preemption": ("swap", "recompute"),
}
BENCHMARK_ONLY = ("load_format", "router_skew", "router_regimes")  # flags that only make sense for random weights


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a checkpoint folder or a Hugging Face repo id
    device: str | None = None  # None: "cuda" when there is a GPU, else "cpu"
    dtype: torch.dtype | str | None = None  # None: the checkpoint's dtype on a GPU, float32 on CPU
    # what the engine may take on the device (weights, pool, activations): bytes or a size such as 30GiB; None: 90% of
    # the GPU's free memory (on CPU: every expert and a little KV)
    gpu_memory_budget: int | str | None = None
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights from config.json)
    router_skew: float = 0.0  # dummy weights only: see rimuru.models.dummy
    router_regimes: int = 1  # dummy weights with a skew: vocabulary parts routed by their own rankings
    max_num_seqs: int = 256  # requests in one batch
    # tokens in one forward pass (prefill chunks + decodes): at 2048 mixed steps' CUDA graphs cover every step and the
    # activation reserve stays small (docs/benchmarks/paper-scenario.md)
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    page_tokens: int = DEFAULT_PAGE_TOKENS  # tokens a KV page holds (lowered to what an expert page carries)
    tokenizer: str | None = None  # None: the checkpoint folder
    expert_policy: str = "elastic"  # "resident" | "fixed" | "elastic" (docs/architecture.md, Expert tiers)
    # elastic cap per layer, also sizing the loading buffers. None: no cap with direct reads (the budget and the cost
    # rule decide); with copies, a quarter of a layer or the least the budget requires, whichever is more
    expert_offload_limit: int | None = None
    # elastic: "cost" evicts only while that raises throughput (rimuru.cost_adjuster), "paper" whenever KV runs
    # short (docs/architecture.md, The adjuster; the two compared in docs/benchmarks/paper-scenario.md)
    adjuster: str = "cost"
    copy_compute_ratio: float = 1.0  # cost: copies up to this x a step's compute hide under it (direct reads never)
    ttft_slo: float | None = None  # cost: seconds the oldest waiting request may wait before evicting despite cost
    offload_per_layer: int | None = None  # experts each layer keeps on the host (fixed); None: a quarter of them
    expert_ranking: str | None = None  # path of expert_ranking.json; None: beside the checkpoint, else uniform
    prefetch: bool = True  # expert_reads="copy": predict the next layer's experts and copy them ahead
    # a routed expert that is on the host: let the expert kernel read its pinned host copy over the host link
    # ("direct": no routing hook, no loading buffers) or "copy" it into a loading buffer first (the hook waits for
    # the router, then copies and prefetches). Direct: docs/benchmarks/paper-scenario.md
    expert_reads: str = "direct"
    cuda_graphs: bool | None = None  # decode steps as CUDA graph replays; None: on a GPU (True on CPU: the same path)
    # steps that mix prefill chunks and decodes (up to 2048 tokens) as graph replays too (with cuda_graphs): their
    # memory pool is profiled at start-up and taken from the pool (docs/benchmarks/vs-vllm.md); a hybrid model's
    # steps with prompt chunks always run eagerly
    mixed_cuda_graphs: bool = True
    # the forward pass through torch.compile (inductor fuses what lies between the rimuru kernels; the CUDA graphs
    # capture the compiled pass); its cache beside Triton's (rimuru.compilation). Off until measured on a GPU
    compile: bool = False
    # launch each step before reading the tokens of the one before, whose ids it takes on the device
    # (rimuru.pending_tokens): the host prepares a step (the elastic pool's adjuster round too) while the GPU runs
    # the last. None: on with one rank, off under tensor parallelism
    async_scheduling: bool | None = None
    # a preempted request's KV: copied to pinned host memory and back ("swap"), or freed and its prompt recomputed
    preemption: str = "swap"
    seed: int = 0
    # GPUs the model is split over (one process a GPU, started by the engine; gloo processes on the CPU):
    # gpu_memory_budget is per GPU; each rank holds its heads and its slice of every expert
    tensor_parallel_size: int = 1
    progress: bool = True

    def offload_count(self, num_experts: int) -> int:
        """Experts a layer may offload under this policy (0 for resident; elastic with copies and no limit: see
        `least_offload_per_layer`, which may raise it); ValueError beyond the layer's experts."""
        if self.expert_policy == "resident":
            return 0
        chosen = self.offload_per_layer if self.expert_policy == "fixed" else self.expert_offload_limit
        name = "offload_per_layer" if self.expert_policy == "fixed" else "expert_offload_limit"
        uncapped = self.expert_policy == "elastic" and self.expert_reads == "direct"
        count = (num_experts if uncapped else num_experts // 4) if chosen is None else chosen
        if not 0 <= count <= num_experts:
            raise ValueError(f"{name} must be in [0, {num_experts}] (the experts of a layer), got {count}")
        return count

    def resolve(self, max_position_embeddings: int, checkpoint_dtype: torch.dtype) -> EngineConfig:
        """A copy with device, dtype, budget and max_model_len filled in; raises ValueError on bad values."""
        import torch
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype or (checkpoint_dtype if torch.device(device).type == "cuda" else torch.float32)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype must be a torch dtype name such as 'bfloat16', got {self.dtype!r}")
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {max_position_embeddings}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_tokens", "router_regimes", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        if self.copy_compute_ratio < 0 or (self.ttft_slo is not None and self.ttft_slo < 0):
            raise ValueError("copy_compute_ratio and ttft_slo must be >= 0")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (the other ranks take rank 0's input ids)")
        budget = parse_bytes(self.gpu_memory_budget)
        _check_device(device, budget)
        _check_tensor_parallel(self, device)
        return replace(self, device=device, dtype=dtype, max_model_len=max_model_len, gpu_memory_budget=budget)


def _check_tensor_parallel(config: EngineConfig, device: str) -> None:
    """One line for what a tensor parallel engine cannot do yet, or GPUs it does not have."""
    import torch

    size = config.tensor_parallel_size
    if size == 1:
        return
    if torch.device(device).type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} GPUs present")
    if config.expert_reads != "direct":
        raise ValueError(f"tensor_parallel_size {size} reads host experts in place only: expert_reads='direct'")


def field_docs() -> dict[str, str]:
    """Each `EngineConfig` field's comment (the line's own, or the lines above it), the command line's help."""
    with open(__file__) as f:
        source = f.read()
    body = source[source.index("class EngineConfig:"):source.index("    def offload_count")]
    docs, above = {}, []
    for line in body.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
        elif ":" in stripped:
            name = stripped.split(":")[0]
            own = [t.string.lstrip("# ") for t in tokenize.generate_tokens(io.StringIO(stripped).readline)
                   if t.type == tokenize.COMMENT]  # fmt: skip
            docs[name], above = " ".join(above + own), []
    return docs
