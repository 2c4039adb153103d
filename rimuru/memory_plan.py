"""How many bytes the page pool gets: the budget minus the weights already on the device and an activation reserve.

`gpu_memory_budget` caps everything the engine takes on the device. Without a budget, a GPU engine takes 90% of
the memory still free after loading the weights; a CPU engine takes the experts plus 256 MiB for KV.
"""

from dataclasses import dataclass

import torch

from rimuru.models import ModelConfig

CPU_DEFAULT_KV_BYTES = 256 * 2**20
CUDA_FREE_FRACTION = 0.9
CUDA_WORKSPACE_BYTES = 512 * 2**20  # cuBLAS/Triton workspaces, allocator slack


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int | None
    weights_bytes: int  # non-expert weights on the device
    activation_bytes: int  # reserved for one forward pass of max_num_batched_tokens
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


def plan_memory(config: ModelConfig, device: torch.device, dtype: torch.dtype, budget: int | None,
                weights_bytes: int, expert_bytes: int, max_tokens: int, max_seqs: int,
                graph_seqs: int = 0, graph_tokens: int = 0) -> MemoryPlan:  # fmt: skip
    """The pool size; ValueError naming the numbers when the budget cannot hold the weights and activations.
    `graph_seqs`: the largest CUDA-graph decode batch and `graph_tokens` the most tokens a graph takes (more than
    `graph_seqs` with mixed steps' graphs): their passes have a memory pool of their own."""
    reserve = activation_bytes(config, dtype, max_tokens, max_seqs)
    mixed = graph_tokens > graph_seqs  # mixed steps' graphs, the larger reserve
    if graph_seqs:
        graph_tokens = max(graph_tokens, graph_seqs)
        # NOTE: the graphs' logits are one fp32 buffer they share; sampling from it runs in the eager reserve's room
        # (H200, Qwen1.5-MoE at 30 GiB: 690 MiB of a 1,768 MiB reserve used at the peak with three copies here)
        reserve += activation_bytes(config, dtype, graph_tokens, graph_seqs, logits_copies=1)
        reserve += graph_point_bytes(config, dtype, graph_tokens)
    if device.type == "cuda":
        reserve += CUDA_WORKSPACE_BYTES
    if budget is not None:
        pool = budget - weights_bytes - reserve
        if pool <= 0:
            raise ValueError(
                f"gpu_memory_budget {budget / 2**30:.2f} GiB cannot hold the non-expert weights "
                f"({weights_bytes / 2**30:.2f} GiB) and the activation reserve ({reserve / 2**30:.2f} GiB); "
                f"lower max_num_batched_tokens{', set mixed_cuda_graphs=False' if mixed else ''} or raise the budget"
            )
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        pool = int(free * CUDA_FREE_FRACTION) - reserve
    else:
        pool = expert_bytes + CPU_DEFAULT_KV_BYTES
    return MemoryPlan(budget, weights_bytes, reserve, pool)
