"""`ModelConfig`: the fields of a Hugging Face `config.json` that Rimuru's Qwen MoE models read.

Owns parsing and the spelling variants found in the wild (`num_local_experts`, `rope_parameters`, `rope_scaling`,
`attention_bias` / `qkv_bias`). Does not own the engine's configuration (`rimuru.config`).
"""

import json
import os
from dataclasses import dataclass, fields

import torch

SUPPORTED_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen2_moe" | "qwen3_moe" (the config's `model_type`)
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int  # L
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hk
    head_dim: int  # Dh
    moe_intermediate_size: int  # F of one routed expert
    shared_expert_intermediate_size: int  # qwen2_moe's shared expert; 0 for qwen3_moe
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

    @classmethod
    def from_hf(cls, source: dict | str | os.PathLike) -> "ModelConfig":
        """Parse a `config.json` given as a dict, the file, or the folder holding it."""
        raw = _read_json(source)
        arch = raw.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}: Rimuru serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            moe_intermediate_size=raw["moe_intermediate_size"],
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
            intermediate_size=raw.get("intermediate_size", 0),
            num_experts=_first(raw, "num_experts", "num_local_experts"),
            num_experts_per_tok=raw["num_experts_per_tok"],
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            qkv_bias=bool(raw.get("qkv_bias", True)) if arch == "qwen2_moe" else bool(raw.get("attention_bias", False)),
            o_proj_bias=arch == "qwen3_moe" and bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=_as_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            initializer_range=raw.get("initializer_range", 0.02),
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

    def replace(self, **changes) -> "ModelConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return ModelConfig(**(values | changes))


def _read_json(source: dict | str | os.PathLike) -> dict:
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
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
