"""The adjusters' host time a scheduling round, on the CPU, for a placement like the paper scenario's mid-run.

    python -m tools.engine.adjuster [--layers 24] [--experts 60] [--offloaded 6] [--waiting 100] [--rounds 2000]

Each round is what `Engine.step` asks of the adjuster, with nothing short and nothing free: the paper rule's
`adjust`, and the cost rule's `adjust` then `observe` (a popularity flush and the swap test every `refresh_every`
rounds) and the estimate refresh `observe` asks for, which the engine runs during the next pass (`refresh_if_due`).
Routing shares are skewed at random (seeded) and the cost model is pinned to an H200-like step (12 ms, 40 tokens, 32
running, 50 GB/s), so every refresh weighs its nominees. What runs between two passes, where the GPU waits for the
host, adds to every step: the figure in parentheses, the refresh left out.
"""

import argparse
import random
import time
from types import SimpleNamespace

import torch

from rimuru.adjuster import Adjuster
from rimuru.cost_adjuster import CostAdjuster
from rimuru.expert_ranking import ExpertRanking
from rimuru.popularity import ExpertPopularity


def skewed_ranking(num_layers: int, num_experts: int, seed: int = 0) -> ExpertRanking:
    rng = random.Random(seed)
    shares = {}
    for layer in range(num_layers):
        row = sorted((rng.random() ** 3 for _ in range(num_experts)), reverse=True)
        shares[layer] = tuple(v / sum(row) for v in row)
    return ExpertRanking(shares)


def cost_adjuster(ranking: ExpertRanking, offloaded: dict[int, set[int]], limit: int) -> CostAdjuster:
    layers = sorted(offloaded)
    host = {layer: SimpleNamespace(matrices=lambda e: [torch.zeros(3 * 704 * 2048, dtype=torch.bfloat16)])
            for layer in layers}  # fmt: skip
    host_tables = torch.zeros(len(layers), len(ranking.shares[layers[0]]), 3, dtype=torch.int32)  # as ExpertStore's
    for layer, experts in offloaded.items():
        host_tables[layer, list(experts)] = -1
    rows = torch.tensor(layers)
    store = SimpleNamespace(host=host, layer_ids=layers, offloaded=offloaded,
                            host_mask=lambda: host_tables.index_select(0, rows)[:, :, 2] < 0,
                            copier=SimpleNamespace(take_timings=lambda: (0, 0.0)))  # fmt: skip
    popularity = ExpertPopularity(ranking, len(ranking.shares[layers[0]]))
    adjuster = CostAdjuster(popularity, limit, store, top_k=4, reads_in_place=lambda: 0, kv_pages_per_expert_page=44)
    adjuster.cost.pin(bandwidth=50e9, compute_s=12e-3, tokens_per_step=40.0, running=32.0, kv_pages_per_request=950.0)
    return adjuster


def per_round_us(round_fn, rounds: int) -> float:
    for _ in range(rounds // 10):  # warm-up
        round_fn()
    start = time.perf_counter()
    for _ in range(rounds):
        round_fn()
    return (time.perf_counter() - start) / rounds * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=60)
    parser.add_argument("--offloaded", type=int, default=6, help="coldest experts of each layer on the host")
    parser.add_argument("--limit", type=int, default=15, help="the offload cap a layer")
    parser.add_argument("--waiting", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    ranking = skewed_ranking(args.layers, args.experts)
    offloaded = {layer: set(range(args.experts - args.offloaded, args.experts)) for layer in range(args.layers)}
    paper, cost = Adjuster(ranking, args.limit), cost_adjuster(ranking, offloaded, args.limit)
    waiting = [SimpleNamespace(request_id=str(i), waiting_since=time.monotonic()) for i in range(args.waiting)]

    def cost_round():
        cost.refresh_if_due()
        cost.adjust(0, 0, offloaded)
        cost.observe(12e-3, 40, waiting, 32, 30_000)

    def cost_between_passes():
        cost.refresh_due = False  # `refresh_if_due` runs while the GPU computes the pass
        cost.adjust(0, 0, offloaded)
        cost.observe(12e-3, 40, waiting, 32, 30_000)

    paper_us = per_round_us(lambda: paper.adjust(0, 0, offloaded), args.rounds)
    cost_us = per_round_us(cost_round, args.rounds)
    between_us = per_round_us(cost_between_passes, args.rounds)
    print(f"{args.layers} layers x {args.experts} experts, {args.layers * args.offloaded} on the host, "
          f"{args.waiting} waiting: paper rule {paper_us:.0f} us a round, cost rule {cost_us:.0f} us a round "
          f"({between_us:.0f} us between the passes, the rest during one)")


if __name__ == "__main__":
    main()
