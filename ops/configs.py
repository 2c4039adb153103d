"""Block sizes for the MoE kernels: tuned tables per GPU (`ops/configs/<GPU>.json`), else a heuristic.

Owns the lookup only; `tools/kernels/tune.py` writes the tables. A table is keyed by "E=..,F=..,D=.." and then by
the number of tokens M (the largest tuned M not above the call's M wins). A GPU without a table of its own takes
the table of its architecture's tuned GPU (`TUNED_FOR_CAPABILITY`): the tiles compile and fit there, and they keep
the launch options (PDL, L2 hints) that the heuristic leaves off.
"""

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


def device_file_name(device_name: str) -> str:
    return device_name.replace(" ", "_").replace("-", "_") + ".json"


# compute capability -> the GPU whose table the others of that architecture take (Hopper: the H100 and H200 share
# the SM, its shared memory and the launch options; their memory rates differ)
TUNED_FOR_CAPABILITY = {(9, 0): "NVIDIA H200"}


@functools.cache
def load_table(device_name: str) -> dict:
    path = CONFIG_DIR / device_file_name(device_name)
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def device_table(device_name: str, capability: tuple[int, int]) -> dict:
    """The GPU's own table, else its architecture's tuned one, else none."""
    return load_table(device_name) or load_table(TUNED_FOR_CAPABILITY.get(capability, device_name))


def heuristic_moe_config(num_tokens: int, num_experts: int, top_k: int, element_size: int = 2) -> dict:
    """Small tiles for decode (the GEMMs are weight-bandwidth bound), large ones when experts hold many tokens.
    fp32 tiles take twice the shared memory: the large one pipelines 2 stages instead of 3 (240 KB > an H200's 227)."""
    tokens_per_expert = num_tokens * top_k / num_experts
    if tokens_per_expert <= 4:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if tokens_per_expert <= 32:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3 if element_size <= 2 else 2}


def lookup(by_tokens: dict, num_tokens: int) -> dict:
    """The entry of the largest tuned M not above `num_tokens` (the smallest tuned M below all of them)."""
    tuned = sorted(int(m) for m in by_tokens)
    below = [m for m in tuned if m <= num_tokens]
    return dict(by_tokens[str(below[-1] if below else tuned[0])])


def moe_config(num_tokens: int, num_experts: int, num_features: int, hidden_size: int, top_k: int, device,
               element_size: int = 2) -> dict:  # fmt: skip
    """Tuned config for this GPU and shape if a table has one (tuned in bf16), else the heuristic."""
    if torch.device(device).type == "cuda" and element_size <= 2:
        tables = device_table(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        table = tables.get(f"E={num_experts},F={num_features},D={hidden_size}")
        if table:
            return lookup(table, num_tokens)
    return heuristic_moe_config(num_tokens, num_experts, top_k, element_size)
