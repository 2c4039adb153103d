"""`ExpertRanking`: how hot each routed expert is, per MoE layer, as its share of routing probability.

Written by `rimuru profile` to `expert_ranking.json` (beside the checkpoint or at a given path) and read by the
engine to choose which experts stay resident. With no ranking every expert is equally hot and ties go to the
lower id; the engine warns, since offloading then picks experts blindly.

File format: {"num_experts": E, "layers": {"<layer index>": [share of expert 0, share of expert 1, ...]}}
"""

import functools
import json
import os
from dataclasses import dataclass

RANKING_FILE = "expert_ranking.json"


def hottest_order(shares) -> tuple[int, ...]:
    """Expert ids by share, highest first; equal shares keep the lower id first."""
    return tuple(sorted(range(len(shares)), key=lambda e: (-shares[e], e)))


@dataclass(frozen=True)
class ExpertRanking:
    shares: dict[int, tuple[float, ...]]  # MoE layer -> [E] share of routing probability (sums to 1 per layer)
    is_uniform: bool = False

    @classmethod
    def uniform(cls, layer_ids: list[int], num_experts: int) -> "ExpertRanking":
        return cls({layer: (1.0 / num_experts,) * num_experts for layer in layer_ids}, is_uniform=True)

    def share(self, layer: int, expert: int) -> float:
        return self.shares[layer][expert]

    @functools.cached_property
    def _order(self) -> dict[int, tuple[int, ...]]:  # sorted once: the adjuster reads it every round
        return {layer: hottest_order(shares) for layer, shares in self.shares.items()}

    def hottest_first(self, layer: int) -> list[int]:
        """Expert ids of `layer`, hottest first; equal shares keep the lower id first."""
        return list(self._order[layer])

    def save(self, path: str | os.PathLike) -> None:
        data = {"num_experts": len(next(iter(self.shares.values()))), "layers": {str(k): list(v) for k, v in self.shares.items()}}
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike, layer_ids: list[int], num_experts: int) -> "ExpertRanking":
        """Read a ranking; ValueError if it does not match the model's layers and experts."""
        with open(path) as f:
            data = json.load(f)
        shares = {int(k): tuple(float(x) for x in v) for k, v in data["layers"].items()}
        if sorted(shares) != sorted(layer_ids) or any(len(v) != num_experts for v in shares.values()):
            raise ValueError(f"{path} ranks layers {sorted(shares)} x {data.get('num_experts')} experts; "
                             f"the model has MoE layers {layer_ids} x {num_experts} experts")  # fmt: skip
        return cls(shares)


def find_ranking(folder: str | None, path: str | None, layer_ids: list[int], num_experts: int) -> ExpertRanking:
    """The ranking at `path`, else beside the checkpoint, else uniform."""
    candidate = path or (os.path.join(folder, RANKING_FILE) if folder else None)
    if candidate and os.path.exists(candidate):
        return ExpertRanking.load(candidate, layer_ids, num_experts)
    if path:
        raise FileNotFoundError(f"expert ranking {path!r} does not exist")
    return ExpertRanking.uniform(layer_ids, num_experts)
