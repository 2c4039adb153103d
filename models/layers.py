"""Building blocks shared by the Qwen MoE families: RMSNorm, RoPE, the dense MLP and paged attention.

Numerics follow Hugging Face transformers' Qwen2/Qwen3 code (RMSNorm in fp32, neox-style RoPE with fp32 angles)
so that fp32 outputs match it to rounding. Attention reads and writes K/V only through `rimuru.ops` and the
`ForwardContext`; this module owns no cache.
Shape letters: T tokens, D hidden, Hq query heads, Hk KV heads, Dh head dim.
"""

import torch
from torch import nn

from rimuru import ops
from rimuru.models import parallel
from rimuru.models.config import ModelConfig
from rimuru.models.context import ForwardContext


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # [T, size]
        """(the norm of x + residual, x + residual) in one kernel; the first layer's input has no residual yet."""
        if residual is None:
            return self(x), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's slice of the vocabulary (`rimuru.models.parallel`): a token outside it
    looks up zeros, and the all-reduce adds the one rank's row that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int):
        shard = parallel.shard()
        self.num_local, self.first = vocab_size // shard.size, shard.rank * (vocab_size // shard.size)
        super().__init__(self.num_local, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        if parallel.shard().size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.num_local)
        return parallel.all_reduce(super().forward(local.clamp(0, self.num_local - 1)) * inside[:, None])


class ParallelLMHead(nn.Linear):
    """The LM head's rows of this rank's slice of the vocabulary; the ranks' logits are gathered side by side."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size // parallel.shard().size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B', D] -> [B', V]
        return parallel.all_gather_last(super().forward(x))


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the default (neox) RoPE for the positions of one step."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # NOTE: computed in fp32 on the CPU exactly as transformers does, then moved with the module.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):  # positions [T]
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, Dh / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers of `mlp_only_layers` and qwen2_moe's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # one GEMM for two
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.intermediate_size = intermediate_size

    def stacked_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The checkpoint's projections each stacked one holds, with their rows, in order (the loader's map)."""
        return {"gate_up_proj": (("gate_proj", self.intermediate_size), ("up_proj", self.intermediate_size))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        # [T, 2F] -> [T, F] -> [T, D]; under tensor parallelism each rank's F slice gives a partial sum
        return parallel.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))))


class Attention(nn.Module):
    """GQA self-attention over paged K/V; qwen3_moe adds a per-head RMSNorm on q and k before RoPE."""

    def __init__(self, config: ModelConfig, layer_idx: int, use_qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        d, dh, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.qkv_proj = nn.Linear(d, (self.num_heads + 2 * self.num_kv_heads) * dh, bias=bias)  # q, k, v rows
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps) if use_qk_norm else None
        self.k_norm = RMSNorm(dh, config.rms_norm_eps) if use_qk_norm else None

    def stacked_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The checkpoint's projections each stacked one holds, with their rows, in order (the loader's map)."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows))}

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q's and k's per-head RMSNorm weights, eps), or Nones where the family has no q/k norm."""
        if self.q_norm is None:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        i = self.layer_idx
        q = ops.rope_write_kv(self.qkv_proj(x), *self.qk_norm_weights(), cos, sin, ctx.kv_view, ctx.slot_mappings[i],
                              self.num_heads, self.num_kv_heads)  # [T, Hq, Dh]; K and V stored in the pool
        out = ops.paged_attention(
            q, ctx.kv_view, ctx.kv_page_tables[i], ctx.seq_lens, ctx.query_start_loc, self.scale
        )  # [T, Hq, Dh]
        return parallel.all_reduce(self.o_proj(out.flatten(1)))  # [T, D]: each rank's heads give a partial sum
