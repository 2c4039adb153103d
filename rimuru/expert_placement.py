"""Start-up placement: which experts begin on the host under each policy, and whether the budget can run it at all.

- resident: none (refuses to start when the experts do not fit, saying by how much);
- fixed: the coldest `offload_per_layer` of every layer, for good;
- elastic: none if everything fits, else the adjuster's coldest nominees until the rest fits.
"""

import logging

from rimuru.adjuster import Adjuster
from rimuru.config import format_bytes
from rimuru.expert_store import ExpertStore
from rimuru.memory import PAGES_PER_EXPERT

logger = logging.getLogger("rimuru")


def initial_offload(policy: str, count: int, store: ExpertStore, adjuster: Adjuster) -> dict[int, set[int]]:
    """Each MoE layer's experts that start on the host (after the loading buffers have been reserved)."""
    offload = {layer: set() for layer in store.layer_ids}
    if policy == "fixed":
        for layer in store.layer_ids:
            offload[layer] = set(adjuster.ranking.hottest_first(layer)[store.num_experts - count :])
    elif policy == "elastic":
        short = store.num_expert_pages - store.allocator.num_free_expert_pages
        if short > 0:
            for layer, expert in adjuster.nominate_evictions(-(-short // PAGES_PER_EXPERT), offload):
                offload[layer].add(expert)
            logger.info("elastic start: %d experts on the host", sum(map(len, offload.values())))
    return offload


def least_offload_per_layer(store: ExpertStore, floor: int) -> int:
    """The fewest experts a layer may offload (at least `floor`) for the pool to hold two loading buffers of that
    many experts, every other expert and one page of KV: what an elastic start with copies and no limit needs."""
    layers, experts, pages = len(store.layer_ids), store.num_experts, store.allocator.num_free_expert_pages
    for count in range(floor, experts + 1):
        if (layers * (experts - count) + 2 * count) * PAGES_PER_EXPERT + 1 <= pages:
            return count
    return experts


def check_budget(policy: str, count: int, store: ExpertStore, pool_bytes: int, buffer_experts: int,
                 outside_pool: int | None = None) -> None:  # fmt: skip
    """ValueError with the numbers when the pool cannot hold the loading buffers and the experts that must stay;
    with `outside_pool` (the budget less the pool) it names the smallest budget that starts."""
    page = store.allocator.sizes.expert_page_bytes
    must_stay = len(store.layer_ids) * (store.num_experts - count) * PAGES_PER_EXPERT
    buffers = 2 * buffer_experts * PAGES_PER_EXPERT
    needed = (must_stay + buffers + 1) * page
    if pool_bytes >= needed:
        return
    smallest = "" if outside_pool is None else f" to at least {format_bytes(outside_pool + needed)}"
    if policy == "resident":
        raise ValueError(
            f"every expert resident needs a pool of {needed / 2**30:.2f} GiB ({must_stay // PAGES_PER_EXPERT} "
            f"experts and one page of KV) but the budget leaves {pool_bytes / 2**30:.2f} GiB: "
            f"{(needed - pool_bytes) / 2**30:.2f} GiB short; raise gpu_memory_budget{smallest} or use "
            f"expert_policy='elastic'"
        )
    raise ValueError(
        f"the pool of {pool_bytes / 2**30:.2f} GiB cannot hold two loading buffers of {buffer_experts} experts "
        f"({buffers * page / 2**30:.2f} GiB) plus the {must_stay // PAGES_PER_EXPERT} experts that must stay "
        f"resident ({must_stay * page / 2**30:.2f} GiB) and one page of KV: {needed / 2**30:.2f} GiB needed; "
        f"raise gpu_memory_budget{smallest} or the offload count"
    )
