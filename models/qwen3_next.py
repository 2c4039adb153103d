"""Qwen3-Next and Qwen3.5: the hybrid MoE decoders. Three of every four layers mix tokens with Gated DeltaNet (linear attention
whose per-request state has a fixed size and lives in SSM and conv pages), the fourth with gated full attention
over KV pages; every layer's MLP is the routed experts plus a sigmoid-gated shared expert (`SparseMoeBlock`).

Numerics follow transformers' Qwen3-Next torch code: zero-centred RMSNorm (x̂ · (1 + w)), per-head q/k norm,
partial neox RoPE, L2-normalised q and k in the delta rule, gated RMSNorm with SiLU(z). Parameter names match the
checkpoint's keys. Shape letters: T tokens, B requests, D hidden, Hq/Hk attention heads, Dh head dim, Hv/Hk' linear
value/key heads, Dv/Dk their dims, C conv channels.
"""

import torch
from torch import nn

from rimuru import ops
from rimuru.models import parallel
from rimuru.models.config import LINEAR_ATTENTION, ModelConfig
from rimuru.models.context import ForwardContext
from rimuru.models.layers import MLP, RotaryEmbedding, VocabParallelEmbedding
from rimuru.models.qwen_moe import QwenMoeForCausalLM, SparseMoeBlock


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored around zero: x̂ · (1 + w), in fp32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's delta-rule output, times SiLU of its gate z."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., size] each
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * nn.functional.silu(gate.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [T, H, Dh]
    """Neox RoPE over the first `cos.shape[-1]` dims of each head; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos[:, None] + rotated * sin[:, None], rest), dim=-1)


class GatedAttention(nn.Module):
    """GQA over KV pages whose output is gated per element by sigmoid of a second half of q_proj."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.kv_idx = config.attention_layer_ids.index(layer_idx)  # its row of the KV tables: linear layers have none
        self.num_heads, self.num_kv_heads, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim, self.scale = dh, dh**-0.5
        d, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(d, self.num_heads * dh * 2, bias=bias)  # per head [query, gate]
        self.k_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=config.o_proj_bias)
        self.q_norm = ZeroCenteredRMSNorm(dh, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(dh, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens, dh = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * dh).chunk(2, dim=-1)  # [T, Hq, Dh] each
        q = partial_rope(self.q_norm(q), cos, sin)
        k = partial_rope(self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, dh)), cos, sin)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, dh)
        i = self.kv_idx
        ops.write_kv(k.contiguous(), v, ctx.kv_view, ctx.slot_mappings[i])
        out = ops.paged_attention(q.contiguous(), ctx.kv_view, ctx.kv_page_tables[i], ctx.seq_lens,
                                  ctx.query_start_loc, self.scale)  # fmt: skip
        # [T, D]: each rank's heads give a partial sum
        return parallel.all_reduce(self.o_proj(out.flatten(1) * torch.sigmoid(gate.reshape(num_tokens, -1))))


class GatedDeltaNet(nn.Module):
    """Linear attention: projections, causal depthwise conv (SiLU), the gated delta rule, gated RMSNorm, out_proj.
    `state_idx` is the layer's row in the context's state tables."""

    def __init__(self, config: ModelConfig, state_idx: int):
        super().__init__()
        self.state_idx = state_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        conv_dim, width, d = 2 * self.key_dim + self.value_dim, config.linear_conv_kernel_dim, config.hidden_size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, bias=False, padding=width - 1)
        self.build_projections(d)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def build_projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def _project(self, x: torch.Tensor):
        """The conv's input [T, C] (q, k, v of every head, in that order), z [T, Hv, Dv], b, a [T, Hv]; Qwen3-Next's
        projections group them per key head."""
        t, hk, group = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        q, k, v, z = self.in_proj_qkvz(x).view(t, hk, -1).split((dk, dk, group * dv, group * dv), dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, -1).split((group, group), dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, -1, dv), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, D]
        mixed, z, b, a = self._project(x)
        t = x.shape[0]
        mixed = self._conv(mixed, ctx)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q, k = q.reshape(t, self.num_k_heads, -1), k.reshape(t, self.num_k_heads, -1)
        v = v.reshape(t, self.num_v_heads, -1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)  # [T, Hv] log decay
        out = self._delta_rule(q, k, v, g, beta, ctx)  # [T, Hv, Dv]
        return parallel.all_reduce(self.out_proj(self.norm(out, z).reshape(t, -1)))  # each rank's heads: a partial sum

    def _conv(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, C]
        weight, ids = self.conv1d.weight.squeeze(1), ctx.conv_state_ids[self.state_idx]
        if ctx.decode_only:
            return ops.causal_conv1d_step(x, ctx.conv_view, ids, weight, None)
        return ops.causal_conv1d_prefill(x, ctx.conv_view, ids, ctx.query_start_loc, ctx.state_continues, weight, None)

    def _delta_rule(self, q, k, v, g, beta, ctx: ForwardContext) -> torch.Tensor:  # [T, Hv, Dv]
        ids = ctx.ssm_state_ids[self.state_idx]
        if ctx.decode_only:
            return ops.gated_delta_step(q, k, v, g, beta, ctx.ssm_view, ids)
        return ops.gated_delta_prefill(q, k, v, g, beta, ctx.ssm_view, ids, ctx.query_start_loc, ctx.state_continues)


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: q, k and v one projection in head order (the conv's input as it is), z, b and a one
    each; stacked here into one GEMM."""

    def build_projections(self, hidden_size: int) -> None:
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj = nn.Linear(hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)

    def stacked_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The checkpoint's four projections in the stacked one, with their rows (the loader's map)."""
        hv = self.num_v_heads
        return {"in_proj": (("in_proj_qkv", self.conv_dim), ("in_proj_z", self.value_dim), ("in_proj_b", hv),
                            ("in_proj_a", hv))}  # fmt: skip

    def _project(self, x: torch.Tensor):
        mixed, z, b, a = self.in_proj(x).split((self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads), -1)
        return mixed, z.reshape(x.shape[0], -1, self.head_v_dim), b, a


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, state_idx: int | None):
        super().__init__()
        self.is_linear = state_idx is not None
        if self.is_linear:
            linear = Qwen35GatedDeltaNet if config.architecture == "qwen3_5_moe" else GatedDeltaNet
            self.linear_attn = linear(config, state_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        dense = not self.is_moe
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else SparseMoeBlock(config, layer_idx)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.is_linear else self.self_attn(h, cos, sin, ctx))  # [T, D]
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, ctx) if self.is_moe else self.mlp(h))  # [T, D]


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        linear = config.linear_layer_ids
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, linear.index(i) if config.layer_types[i] == LINEAR_ATTENTION else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(int(config.head_dim * config.partial_rotary_factor), config.rope_theta)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # input_ids [T] -> [T, D]
        x = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary_emb(ctx.positions, x.dtype)  # [T, rotary dims]
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return x


class Qwen3NextForCausalLM(QwenMoeForCausalLM):
    architecture = "qwen3_next"

    def build_model(self, config: ModelConfig) -> nn.Module:
        return HybridModel(config)


class Qwen35MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 and Qwen3.6 MoE: Qwen3-Next's layers with Qwen3.5's linear-attention projections; text positions
    only, for which its interleaved multimodal RoPE is the partial RoPE."""

    architecture = "qwen3_5_moe"
