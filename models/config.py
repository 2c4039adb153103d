"""`ModelConfig`: the fields of a Hugging Face `config.json` that Rimuru's Qwen MoE models read.

Owns parsing and the spelling variants found in the wild (`num_local_experts`, `rope_parameters`, `rope_scaling`,
`attention_bias` / `qkv_bias`). Does not own the engine's configuration (`rimuru.config`).
"""

import json
import os
from dataclasses import dataclass, fields

import torch

SUPPORTED_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe")
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet and gated attention layers
STATE_DTYPES = ("float32",)  # `mamba_ssm_dtype`s the linear-attention kernels keep the recurrent state in
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen2_moe" | "qwen3_moe" | "qwen3_next" | "qwen3_5_moe" (the config's `model_type`)
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int  # L
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hk
    head_dim: int  # Dh
    moe_intermediate_size: int  # F of one routed expert
    shared_expert_intermediate_size: int  # the gated shared expert of qwen2_moe and the hybrids; 0 for qwen3_moe
    intermediate_size: int  # dense MLP of `mlp_only_layers`
    num_experts: int  # E
    num_experts_per_tok: int  # K
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    qkv_bias: bool  # q/k/v projections; qwen2_moe: `qkv_bias` (default true); qwen3_moe: `attention_bias`
    o_proj_bias: bool  # qwen3_moe: `attention_bias`; qwen2_moe: never
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: torch.dtype
    initializer_range: float = 0.02
    # hybrid models (qwen3_next, qwen3_5_moe): each layer's token mixer, and the Gated DeltaNet geometry of the linear ones
    layer_types: tuple[str, ...] = ()  # LINEAR_ATTENTION | FULL_ATTENTION a layer; empty: every layer full
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates

    @classmethod
    def from_hf(cls, source: dict | str | os.PathLike) -> "ModelConfig":
        """Parse a `config.json` given as a dict, the file, or the folder holding it."""
        raw = _text_config(_read_json(source))
        arch = raw.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}: Rimuru serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        _check_head_split(raw, "num_attention_heads", "num_key_value_heads")
        gated_shared_expert = arch in ("qwen2_moe", *HYBRID_ARCHITECTURES)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            moe_intermediate_size=raw["moe_intermediate_size"],
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if gated_shared_expert else 0,
            intermediate_size=raw.get("intermediate_size", 0),
            num_experts=_first(raw, "num_experts", "num_local_experts"),
            num_experts_per_tok=raw["num_experts_per_tok"],
            norm_topk_prob=_norm_topk_prob(raw, arch),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            qkv_bias=bool(raw.get("qkv_bias", True)) if arch == "qwen2_moe" else bool(raw.get("attention_bias", False)),
            o_proj_bias=arch != "qwen2_moe" and bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=_as_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            initializer_range=raw.get("initializer_range", 0.02),
            **(_hybrid_fields(raw) if arch in HYBRID_ARCHITECTURES else {}),
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Hugging Face's rule for a sparse (routed-expert) layer; the others use the dense MLP."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def linear_layer_ids(self) -> list[int]:
        """The Gated DeltaNet layers of a hybrid model, whose per-request state lives in SSM and conv pages."""
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION]

    @property
    def attention_layer_ids(self) -> list[int]:
        """The layers that keep KV pages: all of them, but a hybrid model's full-attention layers only. Row r of the
        context's KV tables and slot mappings belongs to layer attention_layer_ids[r]."""
        linear = set(self.linear_layer_ids)
        return [i for i in range(self.num_hidden_layers) if i not in linear]

    def shard(self, size: int) -> "ModelConfig":
        """The config of one rank's shard at tensor parallel size `size` (`rimuru.models.parallel`): its heads and
        its slice of every MLP (the vocabulary stays whole here: the embedding and the LM head split it themselves);
        ValueError naming the first field that `size` does not divide."""
        if size == 1:
            return self
        fields_split = {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                        "moe_intermediate_size": self.moe_intermediate_size,
                        "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                        "intermediate_size": self.intermediate_size, "linear_num_key_heads": self.linear_num_key_heads,
                        "linear_num_value_heads": self.linear_num_value_heads}  # fmt: skip
        for name, value in (fields_split | {"vocab_size": self.vocab_size}).items():
            if value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide {name} ({value})")
        if self.o_proj_bias:
            raise ValueError(f"tensor_parallel_size {size}: attention_bias on o_proj is not split yet")
        return self.replace(**{name: value // size for name, value in fields_split.items()})

    def replace(self, **changes) -> "ModelConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return ModelConfig(**(values | changes))


def _text_config(raw: dict) -> dict:
    """Qwen3.5's config as its text model's: a composite checkpoint's `text_config` (the vision tower's config
    dropped, the outer dtype and tie used where the text config has none) and the text-only `qwen3_5_moe_text`, both
    served as `qwen3_5_moe`."""
    if raw.get("model_type") == "qwen3_5_moe" and "text_config" in raw:
        outer = {key: raw[key] for key in ("torch_dtype", "dtype", "tie_word_embeddings") if key in raw}
        raw = outer | raw["text_config"]
    if raw.get("model_type") == "qwen3_5_moe_text":
        raw = raw | {"model_type": "qwen3_5_moe"}
    return raw


def _hybrid_fields(raw: dict) -> dict:
    """A hybrid config's layer kinds (`layer_types`, or every `full_attention_interval`-th layer full) and its
    linear-attention geometry."""
    layers, interval = raw["num_hidden_layers"], raw.get("full_attention_interval", 4)
    types = raw.get("layer_types") or [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                                       for i in range(layers)]  # fmt: skip
    state_dtype = raw.get("mamba_ssm_dtype") or "float32"
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"mamba_ssm_dtype {state_dtype!r}: Rimuru keeps the linear-attention state in "
                         f"{', '.join(STATE_DTYPES)} only")  # fmt: skip
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}: Rimuru runs only {LINEAR_ATTENTION} and {FULL_ATTENTION} layers")
    _check_head_split(raw, "linear_num_value_heads", "linear_num_key_heads")
    if raw.get("attn_output_gate") is False:
        raise ValueError("attn_output_gate false: Rimuru runs a hybrid's full-attention layers gated only")
    rope = raw.get("rope_parameters") or {}
    return dict(
        layer_types=tuple(types),
        linear_num_key_heads=raw["linear_num_key_heads"],
        linear_num_value_heads=raw["linear_num_value_heads"],
        linear_key_head_dim=raw["linear_key_head_dim"],
        linear_value_head_dim=raw["linear_value_head_dim"],
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        # transformers' hybrid configs rotate a quarter of each head unless told otherwise
        partial_rotary_factor=float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
    )


def _norm_topk_prob(raw: dict, arch: str) -> bool:
    """Whether the top-k routing weights are renormalised, as transformers reads it: Qwen3.5's router always does
    (its config has no such field), Qwen3-Next's config defaults it on, the others' off."""
    if arch == "qwen3_5_moe":
        return True
    return bool(raw.get("norm_topk_prob", arch == "qwen3_next"))


def _check_head_split(raw: dict, heads: str, groups: str) -> None:
    """Refuse a head count that is not a whole multiple of its groups' (the kernels share one group among whole
    heads); a missing `groups` field means one group a head."""
    num_heads, num_groups = raw.get(heads), raw.get(groups) or raw.get(heads)
    if num_heads is not None and (num_groups <= 0 or num_heads % num_groups):
        raise ValueError(f"{heads} {num_heads} is not a multiple of {groups} {num_groups}: Rimuru's kernels "
                         f"give each group a whole number of heads")


def _read_json(source: dict | str | os.PathLike) -> dict:
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint folder {os.fspath(source)!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def _first(raw: dict, *names: str):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    raise KeyError(f"config.json has none of {names}")


def _rope_theta(raw: dict) -> float:
    """`rope_theta` at top level (transformers 4), or inside `rope_parameters` (5) / `rope_scaling`."""
    theta = raw.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {key}: Rimuru implements the default RoPE")
        theta = theta if theta is not None else params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (value,)


def _dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch_dtype {name!r} in config.json")
    return dtype
