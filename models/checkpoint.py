"""Reading Hugging Face checkpoints: where the files are, what each key means, and the host expert store's input.

Owns path / repo-id resolution (offline-safe), the safetensors file list, key canonicalisation (the
`model.language_model.` prefix) and the two routed-expert layouts. Does not own the module or the GPU copy of
experts (the expert store in `rimuru` does that from `HostExperts`).

Routed-expert layouts accepted, for MoE layer i (F = moe_intermediate_size, D = hidden_size, E = num_experts):
  per expert  model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   [F, D], [F, D], [D, F]
  fused       model.layers.{i}.mlp.experts.gate_up_proj  [E, 2F, D] (gate rows first: transformers 5)
              model.layers.{i}.mlp.experts.down_proj     [E, D, F]
  The fused tensors are also accepted transposed ([E, D, 2F] / [E, F, D], as Qwen3-VL-MoE stores them) when the
  shape says so unambiguously.
"""

import json
import os
import re
from dataclasses import dataclass

import torch

from rimuru.models import parallel

from .host_memory import pinned_empty

_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_MATRIX = {"gate": 0, "up": 1, "down": 2}
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts in host memory (pinned when CUDA is available), read-only after loading."""

    gate: torch.Tensor  # [E, F, D]
    up: torch.Tensor  # [E, F, D]
    down: torch.Tensor  # [E, D, F]

    @classmethod
    def empty(cls, num_experts: int, num_features: int, hidden_size: int, dtype: torch.dtype) -> "ExpertWeights":
        e, f, d = num_experts, num_features, hidden_size
        return cls(*(pinned_empty(shape, dtype) for shape in ((e, f, d), (e, f, d), (e, d, f))))

    def matrices(self, expert_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of one expert: the three pages' contents, in page-table order."""
        return self.gate[expert_id], self.up[expert_id], self.down[expert_id]


TINY_MODEL_NAME = "tiny-qwen-moe"  # the fabricated checkpoint shipped in the package: `LLM("tiny-qwen-moe")`


def tiny_model_path() -> str:
    """The shipped tiny checkpoint's folder (package data beside the server's assets)."""
    from importlib import resources

    return os.fspath(resources.files("rimuru.serving").joinpath("assets", TINY_MODEL_NAME))


def resolve_folder(path_or_repo_id: str | os.PathLike) -> str:
    """A local folder, the shipped tiny model by its name, or a Hugging Face repo id found in the cache (or
    downloaded unless HF_HUB_OFFLINE is set)."""
    path = os.path.expanduser(os.fspath(path_or_repo_id))
    if os.path.isdir(path):
        return path
    if path == TINY_MODEL_NAME:
        return tiny_model_path()
    if not _looks_like_repo_id(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    return _snapshot(path)


def _looks_like_repo_id(path: str) -> bool:
    return not os.path.isabs(path) and not path.startswith(".") and path.count("/") <= 1 and not os.path.exists(path)


def _is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    hint = f"no local folder {repo_id!r}, and Hugging Face repo {repo_id!r}"
    try:
        return snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS, local_files_only=True)
    except Exception as cached_error:  # noqa: BLE001 - any miss falls through to the download or the message
        if _is_offline():
            raise FileNotFoundError(
                f"{hint} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it first with "
                f"`hf download {repo_id}` (or pass a local folder)"
            ) from cached_error
    try:
        timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT", "10"))
        return snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS, etag_timeout=timeout)
    except Exception as error:  # noqa: BLE001
        raise FileNotFoundError(
            f"{hint} could not be fetched ({type(error).__name__}: {error}); download it with "
            f"`hf download {repo_id}` or pass a local folder"
        ) from error


def safetensors_files(folder: str) -> list[str]:
    """The shard files: from `model.safetensors.index.json`, else `model.safetensors`, else any *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(
            f"no weights in {folder!r}: looked for model.safetensors.index.json, model.safetensors and *.safetensors"
        )
    return [os.path.join(folder, n) for n in found]


def canonical_key(key: str) -> str:
    """Strip wrapper prefixes so every layout reads `model.layers...` / `lm_head...`."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


def parse_expert_key(key: str) -> tuple[int, int | None, str] | None:
    """(layer, expert or None when fused, matrix name) of a routed-expert key; None for any other key."""
    if m := _PER_EXPERT.fullmatch(key):
        return int(m[1]), int(m[2]), m[3]
    if m := _FUSED.fullmatch(key):
        return int(m[1]), None, m[2]
    return None


class ExpertCollector:
    """Fills `ExpertWeights` per MoE layer from checkpoint tensors and reports what never arrived."""

    def __init__(self, moe_layer_ids: list[int], num_experts: int, num_features: int, hidden: int, dtype):
        self.shape = (num_experts, num_features, hidden)
        self.layers = {i: ExpertWeights.empty(num_experts, num_features, hidden, dtype) for i in moe_layer_ids}
        self.filled = {i: torch.zeros(num_experts, 3, dtype=torch.bool) for i in moe_layer_ids}

    def put(self, key: str, parsed: tuple[int, int | None, str], tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into place; False when the key does not belong to this model."""
        layer_idx, expert_id, name = parsed
        if layer_idx not in self.layers or (expert_id is not None and expert_id >= self.shape[0]):
            return False
        weights, filled = self.layers[layer_idx], self.filled[layer_idx]
        e, f, d = self.shape  # f: this rank's features of each expert (`rimuru.models.parallel`)
        full = f * parallel.shard().size
        if expert_id is not None:  # gate, up [F, D] split by rows, down [D, F] by columns
            getattr(weights, name)[expert_id].copy_(parallel.rank_slice(tensor, 1 if name == "down" else 0))
            filled[expert_id, _MATRIX[name]] = True
        elif name == "gate_up_proj":
            gate_up = parallel.rank_slice(_orient(tensor, (e, 2 * full, d), key), 1, parts=2)  # [E, 2F, D]
            weights.gate.copy_(gate_up[:, :f])
            weights.up.copy_(gate_up[:, f:])
            filled[:, :2] = True
        else:
            weights.down.copy_(parallel.rank_slice(_orient(tensor, (e, d, full), key), 2))  # [E, D, F]
            filled[:, 2] = True
        return True

    def missing(self) -> list[str]:
        names = ("gate_proj", "up_proj", "down_proj")
        return [
            f"model.layers.{i}.mlp.experts.{e}.{names[m]}.weight"
            for i, filled in self.filled.items()
            for e, m in (~filled).nonzero().tolist()
        ]


def _orient(tensor: torch.Tensor, shape: tuple[int, int, int], key: str) -> torch.Tensor:
    if tuple(tensor.shape) == shape:
        return tensor
    if tuple(tensor.shape) == (shape[0], shape[2], shape[1]):
        return tensor.transpose(1, 2)
    raise ValueError(f"{key}: shape {tuple(tensor.shape)}, expected {shape} (or its transpose)")
