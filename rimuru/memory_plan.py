"""How many bytes the page pool gets: the budget minus the weights already on the device and an activation reserve.

`gpu_memory_budget` caps everything the engine takes on the device. Without a budget, a GPU engine takes 90% of
the memory still free after loading the weights; a CPU engine takes the experts plus 256 MiB for KV. The reserve is
measured on a GPU (`rimuru.memory_profile`) and estimated elsewhere (`estimated_reserve`).
"""

from dataclasses import dataclass

import torch

from rimuru.config import format_bytes
from rimuru.models import ModelConfig

CPU_DEFAULT_KV_BYTES = 256 * 2**20
CUDA_FREE_FRACTION = 0.9
CUDA_WORKSPACE_BYTES = 512 * 2**20  # cuBLAS/Triton workspaces, allocator slack


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int | None
    weights_bytes: int  # non-expert weights on the device
    activation_bytes: int  # reserved outside the pool for the steps' work (graphs, sampler, eager passes)
    pool_bytes: int


def activation_bytes(config: ModelConfig, dtype: torch.dtype, max_tokens: int, max_seqs: int,
                     logits_copies: int = 3) -> int:  # fmt: skip
    """A generous estimate of the peak of one forward pass: hidden states, q/k/v, MoE intermediates, and
    `logits_copies` fp32 [max_seqs, V] logits (an eager pass: the LM head's, their fp32 copy, the sampler's work)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 16 * config.hidden_size + 4 * config.num_experts_per_tok * config.moe_intermediate_size
    per_token += 4 * max(config.intermediate_size, config.shared_expert_intermediate_size)
    logits = logits_copies * max_seqs * config.vocab_size * 4
    return max_tokens * per_token * elem + logits


def graph_point_bytes(config: ModelConfig, dtype: torch.dtype, max_tokens: int) -> int:
    """The graphs' routing points: every MoE layer's router input and expert ids for `max_tokens` tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return len(config.moe_layer_ids) * max_tokens * (config.hidden_size * elem + config.num_experts_per_tok * 8)


def estimated_reserve(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_tokens: int,
                      max_seqs: int, graph_seqs: int = 0, graph_tokens: int = 0) -> int:  # fmt: skip
    """The activation reserve where it cannot be measured (`rimuru.memory_profile` measures it on a GPU): one eager
    pass of `max_tokens` and, with graphs (`graph_seqs`: the largest decode batch, `graph_tokens`: the most tokens a
    graph takes), their passes' memory pool."""
    reserve = activation_bytes(config, dtype, max_tokens, max_seqs)
    if graph_seqs:
        graph_tokens = max(graph_tokens, graph_seqs)
        reserve += activation_bytes(config, dtype, graph_tokens, graph_seqs, logits_copies=1)
        reserve += graph_point_bytes(config, dtype, graph_tokens)
    if device.type == "cuda":
        reserve += CUDA_WORKSPACE_BYTES
    return reserve


def plan_memory(device: torch.device, budget: int | None, weights_bytes: int, expert_bytes: int,
                reserve: int, min_pool_bytes: int = 1) -> MemoryPlan:  # fmt: skip
    """The pool size; ValueError naming the numbers, and the smallest budget that starts, when the budget cannot hold
    the weights, the `reserve` (what a step takes outside the pool: measured on a GPU, `estimated_reserve`
    elsewhere) and `min_pool_bytes` (one page the pool cuts into KV)."""
    if budget is not None:
        pool = budget - weights_bytes - reserve
        if pool < min_pool_bytes:
            raise ValueError(
                f"gpu_memory_budget {budget / 2**30:.2f} GiB cannot hold the non-expert weights "
                f"({weights_bytes / 2**30:.2f} GiB), the activation reserve ({reserve / 2**30:.2f} GiB) and one page "
                f"of KV; set it to at least {format_bytes(weights_bytes + reserve + min_pool_bytes)}, or lower "
                f"max_num_batched_tokens or max_num_seqs"
            )
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        pool = int(free * CUDA_FREE_FRACTION) - reserve
    else:
        pool = expert_bytes + CPU_DEFAULT_KV_BYTES
    return MemoryPlan(budget, weights_bytes, reserve, pool)
