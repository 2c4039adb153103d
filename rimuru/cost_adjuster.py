"""The cost-aware adjuster (`adjuster="cost"`): evict only while it raises throughput, grow back hottest-first once
pages have stayed free, never bounce.

Pure functions of measured inputs decide the counts (tested on hand-computed cases):
- `profitable_evictions`: how many nominees, cheapest first, can leave while the step's throughput rises. Evicting
  n experts frees the KV pages of n x `requests_per_expert` more running requests, and makes the step longer by the
  link time it is newly exposed to. Copies hidden under `ratio` x the step's compute (prefetched on a side stream)
  cost nothing; direct reads hide nothing. So an eviction is taken while (running + n g) / (step + delta_n) stays >=
  running / step (the link time weighed (1 + `eviction_band`) times). Evictions are one-way while requests wait, so
  the rule evicts only as far as a majority of the last `eviction_votes` refreshes found profitable: the noise
  of one refresh does not ratchet the split past the break-even.
- `plan_cost_adjustment`: short of pages -> evict what is needed, capped by the profitable count unless forced
  (a TTFT target missed, or nothing else can free pages); not short and free pages above the threshold for
  `grow_after_rounds` rounds in a row -> add back; otherwise nothing. There is no precautionary eviction.
- `plan_swaps`: in a round that neither evicts nor adds, host experts whose online share has grown past
  `swap_margin` x a resident expert's of the same layer replace it (the pool split does not move), so the
  placement follows a shifted workload instead of the ranking it started from; a swap copies an expert in, so it
  is taken only when the host touches it saves repay that copy within the rounds it stays settled.

`CostAdjuster` is the thin stateful part: the live measurements (`CostModel`), online popularity
(`ExpertPopularity`, which also orders nominations), hysteresis (an evicted expert stays out for
`readd_after_rounds` rounds; the free-rounds streak) and the estimates the engine exposes in `expert_stats`.
It never touches pages: like `Adjuster`, it returns a `ChangeList` for `ExpertChanges`.

With direct reads (`expert_reads="direct"`) a touched host expert is read over the host link by the expert kernel
instead of copied, and the model's "copy time" is that read time: the measured side is then the reads the manager
counted (`reads_in_place`) times an expert's bytes over the link's measured bandwidth, not the copier's timings
(which see only additions). The predicted link time is scaled up by measured / predicted, both averaged alike
(within `CALIBRATION_RANGE`): the touch model's shares of cold experts come from few routings.

Left out on purpose: the compute a bigger batch adds (at decode sizes a step is bound by reading weights; one
more request adds its KV reads, a few percent of a step) and the higher touch probability of the experts already
offloaded once the batch has grown. The next refresh measures both: it sees the longer step.
"""

import collections
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from rimuru.adjuster import Adjuster, ChangeList
from rimuru.cost_model import CostModel, copy_seconds, ema, exposed_seconds, kv_pages_freed, touch_probability
from rimuru.popularity import ExpertPopularity


@dataclass(frozen=True)
class CostThresholds:
    copy_compute_ratio: float = 1.0  # copies (not direct reads) up to this x a step's compute are hidden, free
    ttft_slo: float | None = None  # seconds the oldest waiting request may wait before evicting despite the cost
    grow_above_free: int = 9  # free expert pages above this let experts come back...
    grow_after_rounds: int = 16  # ...once they have stayed above it this many rounds in a row
    readd_after_rounds: int = 64  # an evicted expert is not added back before this many rounds
    max_add_per_round: int = 5
    cushion_pages: int = 1
    pages_per_expert: int = 3
    swap_margin: float = 2.0  # a host expert replaces its layer's coldest resident one once its share is this x larger
    max_swaps_per_round: int = 2  # each swap copies one expert in
    swap_min_touch_gain: float | None = None  # host touches a step a swap must save; None: 1 / readd_after_rounds
    # an eviction's link time is weighed (1 + this) times against the requests it admits. 0: evict up to the
    # break-even. Near it throughput is flat and the pages still admit requests sooner (mean TTFT): a band of 0.5
    # refused those and left the cost rule's TTFT above the paper rule's at skew 0.5 (`git log -p
    # docs/benchmarks/paper-scenario.md`: the measurement rounds of the cost rule)
    eviction_band: float = 0.0
    # evictions are one-way while requests wait, so noise in the estimates would ratchet the split past the
    # break-even: a refresh votes for a host count (the experts on the host + its profitable evictions) and the
    # rule evicts only up to the lower median of the last this many votes (a majority, in time)
    eviction_votes: int = 8


# measured / predicted link time, as far as it is trusted. Never below 1: the one ratio is set by the warmer experts
# already offloaded, while the cold nominees' shares come from few routings and were underestimated on the H200
# (ratios above 1 at router skew 1.0, and below 1 at skew 0.5 let the rule over-evict: `git log -p
# docs/benchmarks/paper-scenario.md`)
CALIBRATION_RANGE = (1.0, 4.0)
# nominees one refresh weighs (the cheapest, in one tensor pass; `profitable_evictions` walks them in Python); when
# all of them pass and evictions use up half before the next refresh, `observe` asks for one at the next pass
MAX_NOMINEES = 64


def profitable_evictions(step_s: float, running: float, requests_per_expert: float, exposed_s: Iterable[float],
                         band: float = 0.0) -> int:  # fmt: skip
    """How many of the nominees (in order) may leave while the step's throughput rises. `exposed_s`: the link
    seconds a step is exposed to with 0, 1, 2, ... nominees gone. With n gone the batch gains n x
    `requests_per_expert` requests and the step `exposed_s[n] - exposed_s[0]` seconds; evict while
    (running + n g) / (step_s + delta_n) >= running / step_s, i.e. n g step_s >= running delta_n, with the cost
    side weighed (1 + `band`) times. A 0.010 s step of 20 requests, 0.2 requests an expert, each nominee 0.00005 s
    more: 2n >= 1n, all go (and with a band of 0.5, 2n >= 1.5n)."""
    exposed = iter(exposed_s)
    now = next(exposed, None)
    count = 0
    for n, after in enumerate(exposed, start=1):
        if n * requests_per_expert * step_s < (1 + band) * running * (after - now):
            break
        count = n
    return count


def plan_cost_adjustment(short_pages: int, free_pages: int, affordable: int, forced: bool, free_rounds: int,
                         t: CostThresholds = CostThresholds()) -> tuple[int, int]:  # fmt: skip
    """(experts to evict, experts to add). Short by 8, 5 affordable -> (3, 0); short by 8, 1 affordable -> (1, 0),
    or (3, 0) when forced; 20 free for `grow_after_rounds` rounds -> (0, 3); else (0, 0)."""
    if short_pages > 0:
        wanted = -(-(short_pages + t.cushion_pages) // t.pages_per_expert)
        return (wanted if forced else min(wanted, affordable)), 0
    if free_pages > t.grow_above_free and free_rounds >= t.grow_after_rounds:
        return 0, min(t.max_add_per_round, (free_pages - t.grow_above_free) // t.pages_per_expert)
    return 0, 0


def plan_swaps(host_shares: dict[int, dict[int, float]], resident_shares: dict[int, dict[int, float]],
               margin: float, max_swaps: int, touch: Callable[[float], float] = lambda share: share,
               min_touch_gain: float = 0.0) -> list[tuple[int, int, int]]:  # fmt: skip
    """(layer, resident expert out, host expert in), largest gain in share first: in each layer the hottest host
    experts are paired with the coldest resident ones while a host share is above `margin` x its partner's and the
    swap saves at least `min_touch_gain` host touches a step (`touch`: a share's probability of being routed in a
    step). Host 0.3 vs resident 0.1, margin 2 -> swap; 0.15 vs 0.1 -> no swap. Pure."""
    candidates = []
    for layer, on_host in host_shares.items():
        hot = sorted(on_host, key=lambda e: (-on_host[e], e))
        resident = resident_shares.get(layer, {})
        cold = sorted(resident, key=lambda e: (resident[e], e))
        for expert_in, expert_out in zip(hot, cold):
            share_in, share_out = on_host[expert_in], resident[expert_out]
            if share_in <= margin * share_out or touch(share_in) - touch(share_out) < min_touch_gain:
                break
            candidates.append((share_in - share_out, layer, expert_out, expert_in))
    candidates.sort(key=lambda c: (-c[0], c[1:]))
    return [c[1:] for c in candidates[:max_swaps]]


class CostAdjuster:
    def __init__(self, popularity: ExpertPopularity, offload_limit: int, store, top_k: int,
                 thresholds: CostThresholds = CostThresholds(), cost: CostModel | None = None,
                 refresh_every: int = 8, reads_in_place: Callable[[], int] | None = None,
                 kv_pages_per_expert_page: int = 1):  # fmt: skip
        self.popularity, self.offload_limit, self.store, self.top_k = popularity, offload_limit, store, top_k
        self.ranking = popularity  # what `Adjuster` users read
        self.thresholds, self.cost = thresholds, cost or CostModel()
        self.nominator = Adjuster(popularity, offload_limit)
        self.expert_bytes = sum(m.numel() * m.element_size() for m in store.host[store.layer_ids[0]].matrices(0))
        self.round = 0
        self.refresh_every = refresh_every  # rounds between popularity flushes and estimate refreshes (host work)
        self._unflushed = 0  # steps counted on the device since the last flush
        self.evicted_at: dict[tuple[int, int], int] = {}  # (layer, expert) -> round of its last eviction
        self.swapped_in_at: dict[tuple[int, int], int] = {}  # (layer, expert) -> round it was swapped in
        self.free_rounds = 0  # rounds in a row not short and above `grow_above_free`
        self.oldest_wait_s = 0.0
        self.measured_copy_s: float | None = None  # moving average of copy (or direct read) seconds per step
        self.predicted_copy_s: float | None = None  # ...and of the model's prediction, averaged alike
        self._predicted_now = 0.0  # the prediction for the placement at the last refresh
        self.kv_pages_per_expert_page = kv_pages_per_expert_page  # what one evicted expert page holds of KV
        self.reads_in_place = reads_in_place  # direct reads: (layer, expert) host reads counted so far
        self._reads_seen = reads_in_place() if reads_in_place else 0
        self.estimates: dict[str, float] = {}
        self.cost.observe_copies(*store.copier.take_timings())  # start-up placement: the first bandwidth sample
        self._affordable = 0
        self._votes: collections.deque[float] = collections.deque(maxlen=thresholds.eviction_votes)
        self._all_nominees_passed = False  # the last refresh stopped at MAX_NOMINEES, not at an unprofitable one
        self._leaving: list[tuple[int, int]] = []  # this round's evictions and swaps out, applied after the pass
        self.refresh_due = False  # `observe` asked for a refresh that `refresh_if_due` has not run yet
        self.refresh()

    @property
    def slo_missed(self) -> bool:
        return self.thresholds.ttft_slo is not None and self.oldest_wait_s > self.thresholds.ttft_slo

    # ---- the round ---------------------------------------------------------------------------------------------

    def reclaimable_experts(self, offloaded: dict[int, set[int]], stalled: bool = False) -> int:
        """Experts this round may still evict: the affordable ones, or all under the cap when forced. Pure."""
        capped = self.offload_limit * len(offloaded) - sum(map(len, offloaded.values()))
        return capped if stalled or self.slo_missed else min(capped, self._affordable)

    def adjust(self, short_pages: int, free_pages: int, offloaded: dict[int, set[int]],
               stalled: bool = False) -> ChangeList:  # fmt: skip
        """This round's change list. Mutates only the hysteresis state."""
        t = self.thresholds
        self.round += 1
        self.free_rounds = self.free_rounds + 1 if short_pages == 0 and free_pages > t.grow_above_free else 0
        forced = stalled or self.slo_missed
        num_evict, num_add = plan_cost_adjustment(
            short_pages, free_pages, self._affordable, forced, self.free_rounds, t
        )
        changes = ChangeList(evict=self.nominator.nominate_evictions(num_evict, offloaded))
        if num_add:
            changes.add = self.nominator.nominate_additions(num_add, offloaded, held=self._cooling)
        if changes.add:
            self.free_rounds = 0  # NOTE: the next growth waits for the pages to stay free again
        elif short_pages == 0 and not changes.evict and self._unflushed == 0:  # shares are fresh after a flush
            changes.swap = self._swaps(offloaded)
        self._leaving = changes.evict + [(layer, out) for layer, out, _ in changes.swap]
        for key in self._leaving:
            self.evicted_at[key] = self.round
        for layer, _, expert_in in changes.swap:
            self.swapped_in_at[(layer, expert_in)] = self.round
        self._affordable = max(0, self._affordable - len(changes.evict))  # NOTE: stays true until the next refresh
        return changes

    def _cooling(self, layer: int, expert: int) -> bool:
        evicted = self.evicted_at.get((layer, expert))
        return evicted is not None and self.round - evicted < self.thresholds.readd_after_rounds

    def _swaps(self, offloaded: dict[int, set[int]]) -> list[tuple[int, int, int]]:
        """Host experts that became hotter than resident ones (online popularity), outside their cooling time: an
        expert swapped in or out stays put for `readd_after_rounds` rounds, so a swap never bounces. A swap copies
        one expert in, so it must save at least one host touch (a read or a copy of the same bytes) over those
        rounds: a touch gain a step of 1 / `readd_after_rounds` (`swap_min_touch_gain` overrides it). Each layer's
        pairing reads only its ends (`_ends`), found for all layers at once over [L, E]."""
        t, tokens = self.thresholds, self.cost.tokens_per_step
        on_host = self.store.host_mask()  # [L, E]
        if not tokens or not on_host.any():
            return []
        movable = ~self._recently_moved()  # [L, E]
        shares = self.popularity.matrix()  # [L, E]
        if not _some_layer_may_swap(shares, on_host & movable, ~on_host & movable, t.swap_margin):
            return []  # most rounds: what `plan_swaps` would find, without the walks
        hottest = self.popularity.order_matrix()  # [L, E]
        layers = [layer for layer, row in zip(self.popularity.layer_ids, on_host.any(dim=1).tolist()) if row]
        walks = torch.stack([hottest, hottest.flip(1)])  # [2, L, E]: host experts hottest first, resident coldest
        wanted = torch.stack([on_host & movable, ~on_host & movable])
        host, resident = _ends(walks, shares, wanted, t.max_swaps_per_round, self.popularity.layer_ids, layers)
        settled = t.readd_after_rounds
        min_gain = 1 / settled if t.swap_min_touch_gain is None else t.swap_min_touch_gain
        return plan_swaps(host, resident, t.swap_margin, t.max_swaps_per_round,
                          lambda p: touch_probability(p, tokens, self.top_k), min_gain)  # fmt: skip

    def _recently_moved(self) -> torch.Tensor:
        """[L, E] True for the experts evicted, swapped out or swapped in within `readd_after_rounds` rounds (they
        stay put); older entries leave the records here, which keeps them as small as the recent moves."""
        settled = self.thresholds.readd_after_rounds
        for moves in (self.evicted_at, self.swapped_in_at):
            for key in [key for key, moved in moves.items() if self.round - moved >= settled]:
                del moves[key]
        blocked = torch.zeros(self.popularity.matrix().shape, dtype=torch.bool)
        keys = [*self.evicted_at, *self.swapped_in_at]
        if keys:
            blocked[[self.popularity.row[layer] for layer, _ in keys], [expert for _, expert in keys]] = True
        return blocked

    # ---- after the forward pass --------------------------------------------------------------------------------

    def observe(self, step_seconds: float, num_tokens: int, waiting: Sequence = (), running: int = 0,
                kv_pages: int = 0) -> None:  # fmt: skip
        """Feed one step's measurements (wall time, tokens, the waiting queue, the requests running and the KV pages
        in use); every `refresh_every` rounds, pull the routing counts and ask for a refresh of the estimates
        (`refresh_if_due`). Reading the counts waits for the GPU: the engine calls this after the sampler has."""
        if num_tokens > 0:
            self.cost.observe_step(step_seconds, num_tokens, running, kv_pages)
        num_bytes, seconds = self.store.copier.take_timings()
        self.cost.observe_copies(num_bytes, seconds)
        if self.reads_in_place is None:
            self._observe_copy_seconds(seconds)
        self._observe_waiting(waiting)
        self._unflushed += 1
        if self._unflushed >= self.refresh_every or not self.estimates.get("cost_measured"):
            if self.reads_in_place is not None:
                self._observe_reads(self._unflushed)
            self.popularity.flush(self._unflushed)
            self._unflushed = 0
            self.refresh_due = True
        elif self._all_nominees_passed and self._affordable < MAX_NOMINEES // 2:
            self.refresh_due = True  # the next nominees, before the scheduler runs out of evictions it may wait for

    def refresh_if_due(self) -> None:
        """The refresh `observe` scheduled (host work that grows with the layers and experts,
        docs/benchmarks/engine.md), run where the host would otherwise wait: the engine calls it once the next pass is launched,
        before the sampler waits for that pass. The round before it decides from the estimates one step older."""
        if self.refresh_due:
            self.refresh()

    def _observe_copy_seconds(self, seconds: float) -> None:
        """The measured link seconds a step, and beside it (averaged alike, so both lag alike) the prediction for
        the placement of the last refresh: their ratio calibrates the touch model."""
        weight = self.cost.weight
        self.measured_copy_s = ema(self.measured_copy_s, seconds, weight)
        self.predicted_copy_s = ema(self.predicted_copy_s, self._predicted_now, weight)

    def _observe_reads(self, steps: int) -> None:
        """Direct reads: the host reads counted over the last `steps` steps, as link seconds a step (one read of an
        expert's bytes a routed (layer, expert), at the measured bandwidth; reading the count waits for the GPU)."""
        total = self.reads_in_place()
        reads, self._reads_seen = total - self._reads_seen, total
        if self.cost.bandwidth:
            self._observe_copy_seconds(reads / steps * self.expert_bytes / self.cost.bandwidth)

    def _observe_waiting(self, waiting: Sequence) -> None:
        """How long the request that has waited longest (since it last joined the queue) has waited."""
        self.oldest_wait_s = time.monotonic() - min(r.waiting_since for r in waiting) if waiting else 0.0

    def refresh(self) -> None:
        """Recompute the profitable evictions and the estimates from the current measurements and placement."""
        c, self.refresh_due = self.cost, False
        if not c.is_measured or not c.kv_pages_per_request:
            self._affordable, self.estimates = 0, {"cost_measured": 0}
            return
        t, on_host = self.thresholds, self._host_mask_after_round()  # [L, E]
        host_shares = self.popularity.matrix()[on_host]  # [offloaded experts]
        predicted = copy_seconds(host_shares, c.tokens_per_step, self.top_k, self.expert_bytes, c.bandwidth)
        scale, self._predicted_now = self._calibration(), predicted
        hidden = 0.0 if self.reads_in_place is not None else t.copy_compute_ratio * c.compute_s
        gained = kv_pages_freed(1, t.pages_per_expert, self.kv_pages_per_expert_page) / c.kv_pages_per_request
        costs = self._nominee_costs(on_host, scale)
        link = itertools.accumulate(costs, initial=scale * predicted)
        exposed = (exposed_seconds(seconds, hidden) for seconds in link)
        profitable = profitable_evictions(c.compute_s, c.running, gained, exposed, t.eviction_band)
        self._all_nominees_passed = profitable == len(costs) == MAX_NOMINEES
        self._affordable = self._vote(int(on_host.sum()), profitable, len(costs), self._all_nominees_passed)
        self.estimates = self._estimates(host_shares, predicted, scale, gained, costs[0] if costs else 0.0,
                                         profitable)  # fmt: skip

    def _vote(self, on_host: int, profitable: int, nominees: int, unbounded: bool) -> int:
        """Record this refresh's vote (the host count it finds profitable; `unbounded` when every nominee weighed
        passed: more may) and return the evictions the recent majority allows: the lower median vote above the
        experts on the host now, at most the nominees weighed."""
        self._votes.append(math.inf if unbounded else on_host + profitable)
        agreed = lower_median(self._votes)
        return nominees if agreed == math.inf else max(0, min(nominees, int(agreed) - on_host))

    def _host_mask_after_round(self) -> torch.Tensor:
        """[L, E] the store's host mask with this round's evictions and swaps out already on the host: a refresh
        during the pass (`refresh_if_due`) runs before `end_step` applies them, and must not nominate them again."""
        on_host = self.store.host_mask()
        if self._leaving:
            on_host[[self.popularity.row[layer] for layer, _ in self._leaving], [e for _, e in self._leaving]] = True
        return on_host

    def _estimates(self, host_shares: torch.Tensor, predicted_s: float, scale: float, gained: float,
                   next_eviction_s: float, profitable: int) -> dict[str, float]:  # fmt: skip
        """The model's view for `expert_stats`, the metrics and the dashboard: why the pool moved. `host_shares`:
        the offloaded experts' routing shares; `profitable`: what this refresh alone found, beside the majority's
        `_affordable`."""
        c = self.cost
        touched = touch_probability(host_shares, c.tokens_per_step, self.top_k)  # each one's, in a step
        return {
            "cost_measured": 1,
            "cost_bandwidth_gb_s": c.bandwidth / 1e9,
            "cost_compute_ms": c.compute_s * 1e3,
            "cost_tokens_per_step": c.tokens_per_step,
            "cost_running": c.running,
            "cost_requests_per_expert": gained,
            "cost_predicted_copy_ms": predicted_s * 1e3,  # for the experts offloaded now, before the calibration
            "cost_measured_copy_ms": (self.measured_copy_s or 0.0) * 1e3,
            "cost_calibration": scale,
            "cost_affordable_evictions": self._affordable,
            "cost_profitable_this_refresh": profitable,
            "cost_next_eviction_ms": next_eviction_s * 1e3,
            "cost_touch_p_mean": float(touched.mean()) if len(touched) else 0.0,
            "cost_touch_p_max": float(touched.max()) if len(touched) else 0.0,
            "cost_oldest_wait_s": self.oldest_wait_s,
            "cost_slo_missed": int(self.slo_missed),
        }

    def _nominee_costs(self, on_host: torch.Tensor, scale: float) -> list[float]:
        """The link seconds a step (calibrated) of the next evictions, cheapest first, at most MAX_NOMINEES: each
        layer's coldest resident experts up to its offload cap, merged by share. These are the shares
        `Adjuster.eviction_order` nominates, which breaks ties by layer and id (a cost depends on the share alone).
        A few tensor operations over [L, E], not a walk of each layer's ranking (docs/benchmarks/engine.md)."""
        c, matrix = self.cost, self.popularity.matrix()
        budget = self.offload_limit - on_host.sum(dim=1, keepdim=True)  # [L, 1] more evictions each layer may take
        coldest = matrix.masked_fill(on_host, math.inf).sort(dim=1).values  # [L, E] resident shares, coldest first
        ranks = torch.arange(matrix.shape[1])
        shares = coldest[(ranks < budget) & (coldest < math.inf)].sort().values[:MAX_NOMINEES]
        touched = touch_probability(shares, c.tokens_per_step, self.top_k)
        return (touched * (scale * self.expert_bytes / c.bandwidth)).tolist()

    def _calibration(self) -> float:
        """Measured / predicted link seconds a step, within `CALIBRATION_RANGE` (1 until both are known)."""
        if not self.predicted_copy_s or not self.measured_copy_s:
            return 1.0
        low, high = CALIBRATION_RANGE
        return min(high, max(low, self.measured_copy_s / self.predicted_copy_s))


def lower_median(values: Iterable[float]) -> float:
    """The lower of the two middle values (the middle one of an odd count): [3, 0] -> 0, [0, 3, 5] -> 3. Pure."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _some_layer_may_swap(shares: torch.Tensor, host: torch.Tensor, resident: torch.Tensor, margin: float) -> bool:
    """Whether some layer's hottest `host` expert has a share above `margin` x its coldest `resident` one's ([L, E]
    each): `plan_swaps` pairs those two first and stops at the first pair below the margin, so without one it finds
    nothing."""
    hottest_host = torch.where(host, shares, -math.inf).amax(dim=1)  # [L]
    coldest_resident = torch.where(resident, shares, math.inf).amin(dim=1)  # [L]
    return bool((hottest_host > margin * coldest_resident).any())


def _ends(walks: torch.Tensor, shares: torch.Tensor, wanted: torch.Tensor, count: int, layer_ids: list[int],
          layers: list[int]) -> list[dict[int, dict[int, float]]]:  # fmt: skip
    """For each walk w ([W, L, E] expert ids, shares ([L, E]) monotone along each row), {layer: {expert: share}} for
    `layers`: the first `count` experts that are `wanted[w]` ([W, L, E] bool), and any wanted ones after them of the
    same share as the last (`plan_swaps` breaks such ties by id): all that one layer's pairing can reach."""
    along = shares.expand_as(walks).gather(2, walks)  # [W, L, E] in walking order
    keep = wanted.gather(2, walks)
    rank = keep.cumsum(dim=2)  # wanted experts so far, this one included
    nth = keep & (rank == count)  # the count-th wanted one, where a row has that many
    last = torch.where(nth, along, 0.0).sum(dim=2, keepdim=True)  # its share (one term: exact)
    picked = keep & ((rank <= count) | (nth.any(dim=2, keepdim=True) & (along == last)))
    found: list[dict[int, dict[int, float]]] = [{layer: {} for layer in layers} for _ in range(walks.shape[0])]
    index = picked.nonzero(as_tuple=True)
    for walk, row, expert, share in zip(index[0].tolist(), index[1].tolist(), walks[index].tolist(),
                                        along[index].tolist()):  # fmt: skip
        if layer_ids[row] in found[walk]:
            found[walk][layer_ids[row]][expert] = share
    return found
