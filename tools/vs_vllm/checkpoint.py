"""Rimuru's random weights, router skew included, written as a Hugging Face checkpoint, so that vLLM and Rimuru serve
the very same weights (`--load-format dummy` draws each engine's own, and vLLM's routing is as flat as random).

    python -m tools.vs_vllm.checkpoint CONFIG_DIR --out DIR --router-skew 1.0 [--seed 0] [--device cuda]

CONFIG_DIR holds a full-size config.json (`shared/models/*/`). DIR gets config.json and safetensors shards with the
checkpoint's own keys, routed experts one tensor each (`mlp.experts.{e}.gate_proj.weight`, Qwen's release layout).
Loading DIR with `load_format="auto"` gives back exactly the weights `load_format="dummy"` drew at that seed and skew.
"""

import argparse
import json
import os
import shutil
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from rimuru.models import LoadedModel, from_pretrained

SHARD_BYTES = 4 * 2**30


def checkpoint_tensors(loaded: LoadedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, host tensor) of every weight: the module's through its checkpoint layout (a stacked
    projection's rows under each part's key), then each routed expert's three matrices."""
    params = dict(loaded.model.named_parameters(remove_duplicate=False))
    for key, (name, row, shape) in loaded.model.checkpoint_layout().items():
        yield key, params[name].detach().narrow(0, row, shape[0]).cpu().contiguous()
    for layer, experts in loaded.experts.items():
        for e in range(experts.gate.shape[0]):
            for part, matrix in zip(("gate", "up", "down"), experts.matrices(e)):
                yield f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight", matrix.contiguous().clone()


def save_checkpoint(loaded: LoadedModel, out_dir: str, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `loaded`'s weights to `out_dir` in shards of about `shard_bytes` with their index; the shard names."""
    os.makedirs(out_dir, exist_ok=True)
    shards, shard, size, weight_map = [], {}, 0, {}

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shards.append(name)
        shard, size = {}, 0

    for key, tensor in checkpoint_tensors(loaded):
        shard[key], size = tensor, size + tensor.nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    total = sum(os.path.getsize(os.path.join(out_dir, name)) for name in shards)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    shutil.copy(os.path.join(loaded.folder, "config.json"), os.path.join(out_dir, "config.json"))
    return shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", help="a folder with the model's config.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--router-skew", type=float, default=1.0)
    parser.add_argument("--router-regimes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    loaded = from_pretrained(args.config_dir, args.device, getattr(torch, args.dtype), "dummy", args.router_skew,
                             seed=args.seed, router_regimes=args.router_regimes)  # fmt: skip
    shards = save_checkpoint(loaded, args.out)
    print(f"wrote {len(shards)} shards of {args.config_dir}'s random weights (router skew {args.router_skew}, seed "
          f"{args.seed}) to {args.out}")


if __name__ == "__main__":
    main()
