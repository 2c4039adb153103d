"""What vLLM's own start-up log says it took of the GPU, so a side-by-side row can show whether it kept the budget.

vLLM sizes its KV cache from a profiling pass, then captures its CUDA graphs, and logs the parts once they are all
known (vLLM 0.26, `gpu_worker.py`):

    Actual usage is 26.67 GiB for weight, 0.6 GiB for peak activation, 0.22 GiB for non-torch memory, and 0.64 GiB
    for CUDAGraph memory. ... Current kv cache memory in use is 2.51 GiB.

`reserved_gib` is their sum: what vLLM holds while it serves, against the budget it was given.
"""

import re

_USAGE = re.compile(
    r"Actual usage is (?P<weights>[\d.]+) GiB for weight, (?P<activation>[\d.]+) GiB for peak activation, "
    r"(?P<non_torch>[\d.]+) GiB for non-torch memory, and (?P<graphs>[\d.]+) GiB for CUDAGraph memory\..*?"
    r"Current kv cache memory in use is (?P<kv>[\d.]+) GiB"
)


def vllm_memory(log_text: str) -> dict[str, float] | None:
    """The parts of vLLM's last "Actual usage" line in `log_text` and their sum (`reserved_gib`), in GiB; None when
    the log has no such line (an older vLLM, or a start-up that failed before it)."""
    matches = list(_USAGE.finditer(log_text))
    if not matches:
        return None
    parts = {f"{name}_gib": float(value) for name, value in matches[-1].groupdict().items()}
    return parts | {"reserved_gib": round(sum(parts.values()), 2)}
