"""Fabricate tiny random Qwen MoE checkpoints that Hugging Face transformers and Rimuru both load.

Owns the tiny configs, deterministic random weights, and every on-disk variant the loader must accept (expert
layout, key prefix, sharding). Used by tests and by `rimuru fabricate`; never downloads anything.
"""

import json
import os
from collections.abc import Iterator

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file

from rimuru.models.config import ModelConfig
from rimuru.models.qwen_moe import model_class
from rimuru.models.tiny_tokenizer import SPECIAL_TOKENS, train_tokenizer

EXPERT_LAYOUTS = ("per_expert", "fused")
_ARCHITECTURE_CLASSES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                         "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}  # fmt: skip


def tiny_config(arch: str = "qwen2_moe", num_layers: int = 3, mlp_only_layers: tuple[int, ...] = ()) -> dict:
    """A Hugging Face `config.json` dict for a model of a few hundred kilobytes."""
    cfg = {
        "architectures": [_ARCHITECTURE_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "num_experts": 8,
        "norm_topk_prob": arch == "qwen3_moe",
        "mlp_only_layers": list(mlp_only_layers),
        "use_sliding_window": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    if arch == "qwen2_moe":
        cfg |= {"shared_expert_intermediate_size": 64, "qkv_bias": True}
    else:
        cfg |= {"attention_bias": False}
    if arch in ("qwen3_next", "qwen3_5_moe_text"):  # linear, full, linear: Gated DeltaNet on each side of attention
        cfg |= {"shared_expert_intermediate_size": 48, "norm_topk_prob": True, "full_attention_interval": 2,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}}
    if arch == "qwen3_5_moe_text":  # text positions: the three MRoPE sections of the 4 rotated pairs agree
        cfg["rope_parameters"] |= {"mrope_section": [2, 1, 1], "mrope_interleaved": True}
        cfg |= {"attn_output_gate": True, "mamba_ssm_dtype": "float32"}
    return cfg


def composite_config(text: dict) -> dict:
    """Qwen3.5's composite `config.json` around a text config: a vision tower the text model does not run."""
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16},
            "torch_dtype": text["torch_dtype"], "tie_word_embeddings": False}  # fmt: skip


# tensors of a composite Qwen3.5 checkpoint outside its text model: the vision tower and the multi-token head
_NOT_TEXT = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 2), "mtp.fc.weight": (64, 128)}


# what `fabricate` writes: each served family, and Qwen3.5 also as its text model alone
FABRICATED_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def fabricate(
    out_dir: str | os.PathLike,
    arch: str = "qwen2_moe",
    seed: int = 0,
    num_layers: int = 3,
    mlp_only_layers: tuple[int, ...] = (),
    expert_layout: str = "per_expert",
    prefix: str = "model.",
    num_shards: int = 1,
    init_std: float = 0.15,
    config_overrides: dict | None = None,
) -> str:
    """Write config.json, safetensors weights, generation_config.json and a tokenizer to `out_dir`; return it.

    expert_layout: "per_expert" (`mlp.experts.{e}.gate_proj.weight`, the layout of Qwen's releases) or "fused"
    (`mlp.experts.gate_up_proj` [E, 2F, D] with gate rows first, `mlp.experts.down_proj` [E, D, F], the layout of
    transformers 5). prefix: the key prefix of the decoder, "model." or "model.language_model."; arch "qwen3_5_moe" is
    Qwen3.5's composite checkpoint (its text model under "model.language_model.", a vision tower and an MTP head
    beside it), "qwen3_5_moe_text" its text model alone. num_shards > 1
    writes `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`. Same seed, same bytes.
    """
    if arch not in FABRICATED_ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(FABRICATED_ARCHITECTURES)}, got {arch!r}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    os.makedirs(out_dir, exist_ok=True)
    composite = arch == "qwen3_5_moe"
    text_config = tiny_config("qwen3_5_moe_text" if composite else arch, num_layers, mlp_only_layers)
    text_config |= config_overrides or {}
    hf_config = composite_config(text_config) if composite else text_config
    config = ModelConfig.from_hf(hf_config)
    tensors = dict(random_weights(config, seed, init_std, expert_layout))
    tensors = {_with_prefix(name, "model.language_model." if composite else prefix): t for name, t in tensors.items()}
    if composite:
        gen = torch.Generator().manual_seed(seed + 1)
        tensors |= {name: torch.randn(shape, generator=gen) for name, shape in _NOT_TEXT.items()}
    _save_shards(tensors, out_dir, num_shards)
    _write_json(os.path.join(out_dir, "config.json"), hf_config)
    eos = [text_config["eos_token_id"], SPECIAL_TOKENS.index("<|im_end|>")]
    _write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": 0, "eos_token_id": eos})
    train_tokenizer(text_config["vocab_size"]).save_pretrained(out_dir)
    return os.fspath(out_dir)


def random_weights(
    config: ModelConfig, seed: int, std: float, expert_layout: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) in a fixed order; norms are 1 + noise so a wrong norm shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with init_empty_weights():
        skeleton = model_class(config)(config)
    for name, shape in skeleton.checkpoint_shapes().items():
        scale = 0.1 if name.endswith("norm.weight") else std
        offset = 1.0 if name.endswith("norm.weight") else 0.0
        yield name, offset + scale * torch.randn(shape, generator=gen)
    for layer_idx in config.moe_layer_ids:
        yield from _expert_weights(config, layer_idx, gen, std, expert_layout)


def _expert_weights(config: ModelConfig, layer_idx: int, gen: torch.Generator, std: float, layout: str):
    e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
    gate, up, down = (std * torch.randn(shape, generator=gen) for shape in ((e, f, d), (e, f, d), (e, d, f)))
    base = f"model.layers.{layer_idx}.mlp.experts"
    if layout == "fused":
        yield f"{base}.gate_up_proj", torch.cat([gate, up], dim=1)  # [E, 2F, D]
        yield f"{base}.down_proj", down  # [E, D, F]
        return
    for i in range(e):
        yield f"{base}.{i}.gate_proj.weight", gate[i].clone()
        yield f"{base}.{i}.up_proj.weight", up[i].clone()
        yield f"{base}.{i}.down_proj.weight", down[i].clone()


def _with_prefix(name: str, prefix: str) -> str:
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def _save_shards(tensors: dict[str, torch.Tensor], out_dir, num_shards: int) -> None:
    if num_shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
