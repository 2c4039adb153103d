"""`ExpertPopularity`: how often each routed expert is picked now, per MoE layer, learned online from routing.

Counts decay exponentially (`half_life_steps`) so the order follows a shifting workload, and start from the offline
ranking (`rimuru profile`) weighted as `prior_routings` routings a layer, so the first steps are not blind. It reads
like an `ExpertRanking` (`share`, `hottest_first`), so the adjusters order evictions and growth by it.

Counting never adds a host sync: `record_all` adds a pass's [L, E] routed counts (the `RoutingCounter` counts a
pass's top-k ids in one scatter-add, not `torch.bincount`, which reads the largest id back to size its output;
`record` counts one layer's ids), and `flush` pulls the whole [L, E] tensor to the host every few steps,
after a forward pass has synchronised anyway (the sampler reads the tokens). Under async scheduling the next pass
is already queued then, so `lagged` flushes add the counts the flush before copied (`LaggedRead`) and never wait
for it. It does not own the routing hook.
"""

import torch

from rimuru.expert_ranking import ExpertRanking
from rimuru.lagged_read import LaggedRead


class ExpertPopularity:
    def __init__(self, ranking: ExpertRanking, num_experts: int, device: torch.device | str = "cpu",
                 half_life_steps: float = 64.0, prior_routings: float = 1024.0, lagged: bool = False):  # fmt: skip
        self.layer_ids = sorted(ranking.shares)
        self.num_experts = num_experts
        self.row = {layer: i for i, layer in enumerate(self.layer_ids)}
        self.decay = 0.5 ** (1.0 / half_life_steps)  # per step
        prior = torch.tensor([ranking.shares[layer] for layer in self.layer_ids], dtype=torch.float64)  # [L, E]
        self.counts = prior * prior_routings  # [L, E] decayed routings, on the host
        self.pending = torch.zeros(len(self.layer_ids), num_experts, dtype=torch.int64, device=device)  # [L, E]
        self._lagged = LaggedRead(self.pending, zero_after_copy=True) if lagged else None
        self._probs: dict[int, list[float]] = {}  # layer -> [E] shares (rows of `matrix`), cached between flushes
        self._order: dict[int, tuple[int, ...]] = {}  # layer -> expert ids hottest first (rows of `order_matrix`)
        self._matrix: torch.Tensor | None = None  # [L, E] the shares, the same
        self._order_matrix: torch.Tensor | None = None  # [L, E] each row's expert ids hottest first, the same

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one layer's routing ([T, K] expert ids) on the device. No host sync."""
        ids = topk_ids.flatten()  # [T K]
        self.pending[self.row[layer]].index_add_(0, ids, torch.ones_like(ids, dtype=self.pending.dtype))

    def record_all(self, counts: torch.Tensor) -> None:
        """Count a pass's routing of every layer given as per-expert counts ([L, E] int64 on the device, rows in
        `layer_ids` order). No host sync."""
        self.pending += counts

    def flush(self, num_steps: int = 1) -> None:
        """Decay the counts by `num_steps` steps and add what was recorded since the last flush (one device -> host
        copy); `lagged`, what was recorded between the two flushes before."""
        if self._lagged is None:
            recorded = self.pending.cpu().double()  # a copy (on the CPU `.cpu()` is the tensor itself)
            self.pending.zero_()
        else:
            landed = self._lagged.take()
            recorded = 0.0 if landed is None else landed.double()
        self.counts = self.counts * self.decay**num_steps + recorded
        self._probs, self._order, self._matrix, self._order_matrix = {}, {}, None, None

    def share(self, layer: int, expert: int) -> float:
        return self.probabilities(layer)[expert]

    def probabilities(self, layer: int) -> list[float]:
        """[E] each expert's share of the layer's routings (sums to 1). Do not mutate: cached until `flush`."""
        if layer not in self._probs:
            self._probs[layer] = self.matrix()[self.row[layer]].tolist()
        return self._probs[layer]

    def hottest_first(self, layer: int) -> list[int]:
        """Expert ids of `layer`, hottest first; equal shares keep the lower id first. Cached until `flush`."""
        if layer not in self._order:
            self._order[layer] = tuple(self.order_matrix()[self.row[layer]].tolist())
        return list(self._order[layer])

    def matrix(self) -> torch.Tensor:
        """[L, E] float64 shares, rows in `layer_ids` order (a layer never routed to: uniform). Cached until `flush`."""
        if self._matrix is None:
            totals = self.counts.sum(dim=1, keepdim=True)  # [L, 1]
            uniform = torch.full_like(self.counts, 1.0 / self.num_experts)
            self._matrix = torch.where(totals > 0, self.counts / totals.clamp_min(1e-300), uniform)
        return self._matrix

    def order_matrix(self) -> torch.Tensor:
        """[L, E] int64: each layer's expert ids hottest first, as `hottest_first` (one stable sort of the matrix for
        every layer, not a Python sort a layer: 48 layers x 128 experts took a millisecond that way, in the gap
        between two steps). Cached until `flush`."""
        if self._order_matrix is None:
            self._order_matrix = torch.sort(-self.matrix(), dim=1, stable=True).indices  # stable: lower id first
        return self._order_matrix
