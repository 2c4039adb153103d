"""`from_pretrained`: a Qwen MoE checkpoint (or random weights) as a Rimuru model plus host expert weights.

Owns building the module on the meta device and materialising each tensor once: non-expert weights straight onto
`device`, routed experts into host memory (`ExpertWeights` per MoE layer, pinned when CUDA is available). Never
puts the routed experts on the GPU: copying them into pool pages is the expert store's job.
"""

import logging
import os
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from tqdm.auto import tqdm

from rimuru.models import parallel
from rimuru.models.checkpoint import (
    ExpertCollector,
    ExpertWeights,
    canonical_key,
    parse_expert_key,
    resolve_folder,
    safetensors_files,
)
from rimuru.models.config import ModelConfig
from rimuru.models.dummy import apply_router_skew, dummy_experts, fill_dummy_weights
from rimuru.models.qwen_moe import QwenMoeForCausalLM, model_class

logger = logging.getLogger("rimuru")
# a composite Qwen3.5 checkpoint's tensors outside the text model: its vision tower and multi-token-prediction head
NOT_TEXT_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


@dataclass
class LoadedModel:
    model: QwenMoeForCausalLM  # non-expert weights on the device, eval mode
    config: ModelConfig
    experts: dict[int, ExpertWeights]  # decoder layer index -> host experts; MoE layers only
    folder: str  # checkpoint folder (config.json, tokenizer files; dummy weights need only config.json)

    @property
    def tokenizer_path(self) -> str:
        return self.folder


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    load_format: str = "auto",
    router_skew: float = 0.0,
    progress: bool = True,
    seed: int = 0,
    router_regimes: int = 1,
) -> LoadedModel:
    """Load a qwen2_moe / qwen3_moe checkpoint from a folder or a Hugging Face repo id.

    dtype: defaults to the config's torch_dtype. load_format "auto" reads safetensors; "dummy" reads only
    config.json and draws random weights (see `rimuru.models.dummy`, which also documents `router_skew` and
    `router_regimes`).
    Routed experts end up in `LoadedModel.experts`, never in the module. A repo id is looked up in the Hugging
    Face cache only when HF_HUB_OFFLINE is set.
    """
    folder = resolve_folder(path_or_repo_id)
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"no config.json in checkpoint folder {folder!r}")
    config = ModelConfig.from_hf(folder).shard(parallel.shard().size)  # this rank's heads and features
    dtype = dtype or config.torch_dtype
    device = torch.device(device)
    with init_empty_weights():
        model = model_class(config)(config)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    params, weights = _allocate(model, device, dtype)
    if load_format == "dummy":
        fill_dummy_weights(weights, config, seed)
        experts = dummy_experts(config, device, dtype, seed, progress)
        if router_skew > 0:
            apply_router_skew(weights, experts, config, router_skew, seed, router_regimes)
    else:
        experts = _read_checkpoint(weights, config, folder, progress)
    _assign(model, params, device)
    model.prepare_loaded_weights()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the random experts' device scratch, before the pool is sized
    return LoadedModel(model=model.eval(), config=config, experts=experts, folder=folder)


def _allocate(model: QwenMoeForCausalLM, device, dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameter name -> its tensor, checkpoint key -> the rows of its parameter), all allocated empty on `device`
    before any is filled. A stacked projection is one allocation that its parts are read into: parts allocated on
    their own and freed once stacked left holes the caching allocator kept reserved (1 GiB over the budget)."""
    layout = model.checkpoint_layout()
    shapes = dict(model.named_parameters(remove_duplicate=False))
    params = {name: torch.empty(shapes[name].shape, device=device, dtype=dtype)
              for name in dict.fromkeys(name for name, _, _ in layout.values())}  # fmt: skip
    weights = {key: params[name].narrow(0, row, shape[0]) for key, (name, row, shape) in layout.items()}
    filled = {}
    for name, row, shape in layout.values():
        filled[name] = max(filled.get(name, 0), row + shape[0])
    for name, rows in filled.items():
        params[name][rows:].zero_()  # alignment padding past a stacked projection's parts: no key fills it
    return params, weights


def _read_checkpoint(weights: dict[str, torch.Tensor], config: ModelConfig, folder: str, progress: bool):
    """Every tensor of every shard, once: experts to host buffers, the rest into `weights` (the rows of each
    checkpoint key in its parameter, on the device, in the model's dtype)."""
    dtype = next(iter(weights.values())).dtype
    collector = ExpertCollector(
        config.moe_layer_ids, config.num_experts, config.moe_intermediate_size, config.hidden_size, dtype
    )
    read, unexpected, not_text = set(), [], 0
    size = parallel.shard().size  # a linear layer's whole key and value widths, whose heads the ranks split
    linear_widths = (config.linear_num_key_heads * config.linear_key_head_dim * size,
                     config.linear_num_value_heads * config.linear_value_head_dim * size)  # fmt: skip
    files = safetensors_files(folder)
    with tqdm(total=len(files), desc="Loading shards", unit="shard", disable=not progress) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.startswith(NOT_TEXT_PREFIXES):
                        not_text += 1
                        continue
                    name = canonical_key(key)
                    parsed = parse_expert_key(name)
                    if parsed is not None:
                        accepted = collector.put(name, parsed, f.get_tensor(key))
                    elif name in weights:
                        blocks = parallel.qkv_blocks(name, *linear_widths)
                        tensor = parallel.rank_slice(f.get_tensor(key), parallel.slice_dim(name), blocks)
                        shape, wanted = [*tensor.shape], [*weights[name].shape]
                        if (accepted := shape == wanted):
                            weights[name].copy_(tensor)
                            read.add(name)
                        else:
                            key = f"{key} of shape {shape}, not {wanted}"
                    else:  # tied: the embedding is the head
                        accepted = name == "lm_head.weight" and config.tie_word_embeddings
                    if not accepted:
                        unexpected.append(key)
            bar.update(1)
    if not_text:
        logger.info("skipped %d tensors of the vision tower and the multi-token-prediction head (%s): Rimuru serves "
                    "the text model", not_text, ", ".join(f"{p}*" for p in NOT_TEXT_PREFIXES))  # fmt: skip
    _check_keys(folder, sorted(weights.keys() - read) + collector.missing(), unexpected)
    return collector.layers


def _check_keys(folder: str, missing: list[str], unexpected: list[str]) -> None:
    if not missing and not unexpected:
        return
    parts = [f"{len(missing)} missing (e.g. {missing[:5]})" if missing else ""]
    parts += [f"{len(unexpected)} unexpected (e.g. {unexpected[:5]})" if unexpected else ""]
    raise ValueError(f"checkpoint {folder!r} does not match the model: " + "; ".join(p for p in parts if p))


def _assign(model: QwenMoeForCausalLM, params: dict[str, torch.Tensor], device) -> None:
    """Swap the meta parameters for the loaded tensors (no copy) and move the buffers (RoPE table) to `device`."""
    model.load_state_dict(params, strict=False, assign=True)
    model.tie_weights()
    model.to(device)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"parameters left unloaded: {meta[:5]}")
