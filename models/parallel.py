"""Tensor parallelism over the GPUs of one host: which shard of every weight this process holds, and the two
collectives a layer needs (docs/architecture.md, Tensor parallelism).

Rank r of `size` holds heads [r H/size, (r+1) H/size) of attention (column-parallel q, k, v; row-parallel o), and
features [r F/size, (r+1) F/size) of every MLP: the dense ones, the shared expert and each routed expert (gate and
up by rows, down by columns), so the pool's expert pages hold F/size-wide slices, and rows [r V/size, (r+1) V/size)
of the embedding and the LM head. The router and the norms are whole on every rank. Each rank's attention and MLP
outputs and its embedding rows are partial sums, added across ranks by one all-reduce each; the LM head's logits
are gathered. The state is per process (one rank a process), as torch.distributed's is; a
single process is rank 0 of 1 and every collective is a no-op.
"""

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1


_shard = Shard()

# checkpoint keys split by rows (column-parallel: each rank computes its outputs) or by columns (row-parallel: each
# rank reads its inputs); every other key is whole on every rank
_ROWS = re.compile(r".*\.(self_attn\.(q|k|v)_proj|mlp\.(shared_expert\.)?(gate|up)_proj"
                   r"|linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_z|in_proj_b|in_proj_a))\.(weight|bias)"
                   r"|.*\.linear_attn\.(A_log|dt_bias)")  # fmt: skip
_COLUMNS = re.compile(r".*\.(self_attn\.o_proj|mlp\.(shared_expert\.)?down_proj|linear_attn\.out_proj)\.weight")
# q, k and v of every linear-attention head side by side: each rank takes its heads of each of the three
_QKV_BLOCKS = re.compile(r".*\.linear_attn\.(in_proj_qkv|conv1d)\.weight")
_VOCABULARY = re.compile(r"(model\.embed_tokens|lm_head)\.weight")


def init(rank: int, size: int) -> None:
    """This process is `rank` of `size` (torch.distributed's default group already set up for `size` > 1)."""
    global _shard
    if size > 1 and not (dist.is_initialized() and dist.get_world_size() == size and dist.get_rank() == rank):
        raise RuntimeError(f"rank {rank} of {size}: torch.distributed's default group is not set up for it")
    _shard = Shard(rank, size)


def shard() -> Shard:
    return _shard


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's partial `x`, in place (a no-op on one rank)."""
    if _shard.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, in rank order (`x` itself on one rank)."""
    if _shard.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_shard.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def slice_dim(key: str) -> int | None:
    """The dimension of checkpoint tensor `key` that ranks split (0 rows, 1 columns), None when it is whole."""
    if _ROWS.fullmatch(key) or _VOCABULARY.fullmatch(key) or _QKV_BLOCKS.fullmatch(key):
        return 0
    if _COLUMNS.fullmatch(key):
        return 1
    return None


def qkv_blocks(key: str, key_dim: int, value_dim: int) -> list[int] | int:
    """The blocks `rank_slice` splits checkpoint tensor `key` by: a linear layer's [q; k; v] rows (the full key and
    value widths), else one block."""
    return [key_dim, key_dim, value_dim] if _QKV_BLOCKS.fullmatch(key) else 1


def rank_slice(tensor: torch.Tensor, dim: int | None, parts: int | list[int] = 1) -> torch.Tensor:
    """This rank's part of a checkpoint tensor split along `dim`: of each of its blocks (`parts` equal ones, or of
    the sizes listed: a stacked [gate; up] or [q; k; v] split block by block), the rank-th 1/size."""
    if dim is None or _shard.size == 1:
        return tensor
    blocks = tensor.chunk(parts, dim) if isinstance(parts, int) else tensor.split(parts, dim)
    return torch.cat([b.chunk(_shard.size, dim)[_shard.rank] for b in blocks], dim)
