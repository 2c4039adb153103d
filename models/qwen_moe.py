"""Qwen2-MoE and Qwen3-MoE decoders on Rimuru's paged ops.

Parameter names match Hugging Face checkpoint keys, except the routed experts: they are not parameters here. They
live in pool pages owned by the expert store, and a MoE layer reaches them only through
`ctx.expert_view` and `ctx.expert_page_tables[layer_idx]` (docs/architecture.md, Expert tiers). The two families
differ in two switches: qwen2_moe has a gated shared expert, qwen3_moe a per-head q/k RMSNorm. Each MoE layer calls
the context's routing hook between its router and its expert kernel (`rimuru.models.pieces`), so a runner can act
there, eagerly or between CUDA graph replays; without a hook the pass has no Python control flow on tensor values.
Shape letters: T tokens, B' tokens whose logits are wanted, D hidden, E experts, K top-k, V vocabulary.
"""

import torch
from torch import nn

from rimuru import ops
from rimuru.models import parallel
from rimuru.models.config import ModelConfig
from rimuru.models.context import ForwardContext
from rimuru.models.layers import MLP, Attention, ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from rimuru.models.pieces import call_routing_hook


class GatedSharedExpert(nn.Module):
    """qwen2_moe's shared expert and its sigmoid gate: gate rows, up rows and the gate's row are one projection, one
    GEMM (a GEMM of the gate's single output column costs as much as a small one), padded to 8 rows past them.

    NOTE: an output row of 2F + 1 values is not 16-byte aligned, and cuBLAS then falls back to a GEMM several times
    slower than the aligned one (docs/benchmarks/engine.md); the padding rows are zero and their outputs unread."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_gate_proj = nn.Linear(hidden_size, 2 * intermediate_size + 8, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [T, D]
        """The gate's logits [T, 1] and the expert's output [T, D]."""
        rows = 2 * self.intermediate_size
        projected = self.gate_up_gate_proj(x)  # [T, 2F + 8]
        return projected[:, rows : rows + 1], self.down_proj(ops.silu_and_mul(projected[:, :rows]))


class SparseMoeBlock(nn.Module):
    """Router (`gate`), routed experts through `rimuru.ops.paged_moe`, and qwen2_moe's optional shared expert."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.num_features = config.moe_intermediate_size
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedSharedExpert(config.hidden_size, config.shared_expert_intermediate_size)

    def stacked_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The checkpoint's shared-expert projections and gate in the stacked one, with their rows (the loader's map;
        names relative to this block)."""
        if self.shared_expert is None:
            return {}
        f = self.shared_expert.intermediate_size
        return {"shared_expert.gate_up_gate_proj": (("shared_expert.gate_proj", f), ("shared_expert.up_proj", f),
                                                    ("shared_expert_gate", 1))}  # fmt: skip

    def keep_router_in_fp32(self) -> None:
        """The router's weight kept in fp32, so a step does not cast it again; the loader calls this once loaded.
        A 16-bit router on a GPU keeps none: cuBLAS multiplies it into fp32 logits (`route`)."""
        weight = self.gate.weight.detach()
        multiplies_into_fp32 = weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
        self.register_buffer("router_weight", None if multiplies_into_fp32 else weight.float(), persistent=False)

    def route(self, x: torch.Tensor, padding_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, K] and their fp32 weights [T, K] (x [T, D]); logits and softmax in fp32; rows flagged
        in `padding_rows` route as row 0."""
        if self.router_weight is None:
            # 16-bit products are exact in fp32 and cuBLAS sums them in fp32: the fp32 GEMM's logits, without a cast
            # of x and an fp32 GEMM a layer
            logits = torch.mm(x, self.gate.weight.T, out_dtype=torch.float32)  # [T, E]
        else:
            logits = nn.functional.linear(x.float(), self.router_weight)  # [T, E]
        return ops.topk_softmax(logits, self.top_k, self.norm_topk_prob, padding_rows)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # x [T, D] -> [T, D]
        topk_ids, topk_weights = self.route(x, ctx.padding_rows)  # [T, K]
        if ctx.on_routing is not None:
            call_routing_hook(ctx.on_routing, self.layer_idx, x, topk_ids)
        page_table = ctx.expert_page_tables[self.layer_idx]  # [E, 3], read after the hook may have edited it
        host = ctx.host_experts.get(self.layer_idx) if ctx.host_experts else None
        out = ops.paged_moe(x, ctx.expert_view, page_table, topk_ids, topk_weights, self.num_features, host)  # [T, D]
        if self.shared_expert is not None:
            out = ops.sigmoid_gated_add(out, *self.shared_expert(x))
        return parallel.all_reduce(out)  # each rank's slice of every expert gives a partial sum


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, use_qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, use_qk_norm)
        self.is_moe = config.is_moe_layer(layer_idx)
        dense = not self.is_moe
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else SparseMoeBlock(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x the previous layer's output and residual the stream before it (None at the first layer): returns this
        layer's MLP output and the stream before it; each norm adds the two in its own kernel, as vLLM's layers do."""
        h, residual = self.input_layernorm.add(x, residual)  # [T, D] each
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, cos, sin, ctx), residual)
        return (self.mlp(h, ctx) if self.is_moe else self.mlp(h)), residual


class QwenMoeModel(nn.Module):
    """Embedding and decoder layers; returns the last hidden state before the final norm."""

    def __init__(self, config: ModelConfig, use_qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, use_qk_norm) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # input_ids [T] -> [T, D]
        x, residual = self.embed_tokens(input_ids), None  # [T, D]
        cos, sin = self.rotary_emb(ctx.positions, x.dtype)  # [T, Dh]
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return x + residual


class QwenMoeForCausalLM(nn.Module):
    """The common causal LM; use the family classes below so the switches follow the checkpoint."""

    use_qk_norm = False
    architecture = ""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} cannot run a {config.architecture!r} checkpoint")
        self.config = config
        self.model = self.build_model(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def build_model(self, config: ModelConfig) -> nn.Module:
        """The decoder stack: embedding, layers, final norm and rotary tables (a hybrid family builds its own)."""
        return QwenMoeModel(config, self.use_qk_norm)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint says so (call again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_loaded_weights(self) -> None:
        """Each router's weight in fp32 where a step needs it; the loader calls this once the weights are in."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.keep_router_in_fp32()

    def checkpoint_layout(self) -> dict[str, tuple[str, int, torch.Size]]:
        """Checkpoint key -> (parameter name, first row, shape) of every non-expert weight: a stacked projection
        (`stacked_parts`: QKV, each MLP's gate and up, the shared expert's gate, up and gate row) takes its parts' rows in order. Without `lm_head.weight` when
        tied.

        NOTE: under `accelerate.init_empty_weights` the tie in `__init__` is replaced by two meta tensors, so the
        tie is read from the config here, not from parameter identity."""
        stacked = {f"{prefix}.{name}": (prefix, parts) for prefix, module in self.named_modules()
                   if hasattr(module, "stacked_parts") for name, parts in module.stacked_parts().items()}  # fmt: skip
        layout = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            owner, _, kind = name.rpartition(".")  # "model.layers.0.self_attn.qkv_proj", "weight"
            prefix, parts = stacked.get(owner, ("", ()))  # parts named relative to the module that stacks them
            row = 0
            for part, rows in parts:
                layout[f"{prefix}.{part}.{kind}"] = (name, row, torch.Size((rows, *param.shape[1:])))
                row += rows
            if owner not in stacked:
                layout[name] = (name, 0, param.shape)
        if self.config.tie_word_embeddings:
            layout.pop("lm_head.weight")
        return layout

    def checkpoint_shapes(self) -> dict[str, torch.Size]:
        """Checkpoint key -> shape of every non-expert weight (`checkpoint_layout`)."""
        return {key: shape for key, (_, _, shape) in self.checkpoint_layout().items()}

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # input_ids [T] -> [B', V]
        """The logits of the tokens `ctx.logits_indices` names, calling `ctx.on_routing` at each MoE layer's routing."""
        x = self.model(input_ids, ctx)  # [T, D]
        x = self.model.norm(x[ctx.logits_indices])  # [B', D]
        return self.lm_head(x)  # [B', V]

    @property
    def moe_layer_ids(self) -> list[int]:
        return self.config.moe_layer_ids


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    architecture = "qwen2_moe"


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    use_qk_norm = True
    architecture = "qwen3_moe"


def model_class(config: ModelConfig) -> type[QwenMoeForCausalLM]:
    from rimuru.models.qwen3_next import Qwen3NextForCausalLM, Qwen35MoeForCausalLM  # they build on this module

    classes = (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen35MoeForCausalLM)
    return {cls.architecture: cls for cls in classes}[config.architecture]
