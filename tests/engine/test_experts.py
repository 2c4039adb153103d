"""Elastic expert offloading: the paper's rule, nomination by ranking, ordering, and the invariant that memory
policy and budget change speed, never tokens."""

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru import LLM, SamplingParams
from rimuru.adjuster import Adjuster, plan_adjustment
from rimuru.expert_copier import ExpertCopier
from rimuru.expert_ranking import ExpertRanking
from rimuru.memory import EXPERT
from tests.engine.conftest import MAX_TOKENS, expect_no_growth, free_gpu_memory

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "short, free, expected",
    [(8, 0, (3, 0)), (1, 5, (1, 0)), (0, 1, (1, 0)), (0, 20, (0, 3)), (0, 50, (0, 5)), (0, 2, (0, 0)), (0, 9, (0, 0))],
)
def test_plan_adjustment_on_the_papers_numbers(short, free, expected):
    assert plan_adjustment(short, free) == expected


def nominate_one_at_a_time(ranking, limit, count, offloaded, evict):
    """The nomination rule spelled out: `count` times, every layer that may still give (evict: under the limit,
    with a resident expert; add: with a host expert) offers its coldest resident or hottest host expert, and the
    coldest offer (hottest, to add) wins, ties to the lower layer."""
    on_host, chosen = {layer: set(experts) for layer, experts in offloaded.items()}, []
    for _ in range(count):
        offers = []
        for layer, experts in on_host.items():
            order = ranking.hottest_first(layer)
            candidates = [e for e in order if (e in experts) != evict]
            if candidates and (not evict or len(experts) < limit):
                expert = candidates[-1] if evict else candidates[0]
                share = ranking.share(layer, expert)
                offers.append((share if evict else -share, layer, expert))
        if not offers:
            break
        _, layer, expert = min(offers)
        on_host[layer] ^= {expert}
        chosen.append((layer, expert))
    return chosen


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_nomination_matches_the_rule_spelled_out(data):
    """`Adjuster.nominate_*` walks each layer's ranking lazily; it must choose what the one-at-a-time rule does."""
    num_layers, num_experts = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
    shares = st.lists(st.sampled_from([0.05, 0.1, 0.2, 0.3]), min_size=num_experts, max_size=num_experts)
    ranking = ExpertRanking({2 * layer: tuple(data.draw(shares)) for layer in range(num_layers)})  # ties included
    limit = data.draw(st.integers(0, num_experts))
    host_ids = st.lists(st.integers(0, num_experts - 1), max_size=limit)
    offloaded = {layer: set(data.draw(host_ids)) for layer in ranking.shares}
    count = data.draw(st.integers(0, num_layers * num_experts + 1))
    adjuster = Adjuster(ranking, limit)
    for evict, nominate in ((True, adjuster.nominate_evictions), (False, adjuster.nominate_additions)):
        assert nominate(count, offloaded) == nominate_one_at_a_time(ranking, limit, count, offloaded, evict)


def test_nomination_follows_the_ranking_and_the_limit():
    ranking = ExpertRanking({0: (0.4, 0.3, 0.2, 0.1), 1: (0.05, 0.15, 0.5, 0.3)})
    adjuster = Adjuster(ranking, offload_limit=2)
    # coldest kept: layer 1 expert 0 (0.05), layer 0 expert 3 (0.1), layer 1 expert 1 (0.15); layer 1 then at limit
    assert adjuster.nominate_evictions(4, {0: set(), 1: set()}) == [(1, 0), (0, 3), (1, 1), (0, 2)]
    assert adjuster.nominate_evictions(3, {0: {3, 2}, 1: {0}}) == [(1, 1)]  # layer 0 is at its limit
    assert adjuster.nominate_additions(2, {0: {3, 2}, 1: {0, 1}}) == [(0, 2), (1, 1)]
    assert adjuster.adjust(8, 0, {0: set(), 1: set()}).evict == [(1, 0), (0, 3), (1, 1)]


def budget_for(folder: str, kv_tokens: int, offload: int, **options) -> int:
    """Room for two loading buffers of `offload` experts, every expert, and KV for `kv_tokens` tokens a layer, with
    the activation reserve of an engine of `options` (resident unless they name a policy: on a GPU the reserve is
    measured, and a policy's graphs and a compiled pass's differ)."""
    engine = LLM(folder, progress=False, **({"expert_policy": "resident"} | options)).engine
    plan, sizes, config = engine.memory_plan, engine.pool.sizes, engine.model_config
    expert_pages = engine.experts.num_expert_pages + 2 * offload * 3
    kv_pages = -(-kv_tokens // sizes.page_tokens) * config.num_hidden_layers
    pages = expert_pages + -(-kv_pages // sizes.kv_pages_per_expert_page)
    engine.close()  # its memory, and a tensor parallel engine's other ranks
    free_gpu_memory()
    return plan.weights_bytes + plan.activation_bytes + pages * sizes.expert_page_bytes


def run(folder, prompts, prepare=None, **options):
    """Greedy tokens of `prompts` under engine `options`; `prepare(engine)` runs before generating."""
    llm = LLM(folder, progress=False, **options)
    if prepare is not None:
        prepare(llm.engine)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.engine.allocator.check_integrity()
    assert torch.equal(llm.engine.experts.host_tables, llm.engine.experts.page_tables.cpu())  # the hook's host copy
    return llm.engine, tokens


def test_policies_and_budgets_change_speed_never_tokens(family, monkeypatch):
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    copy = dict(expert_reads="copy")  # direct reads (the default): test_direct_reads_change_speed_never_tokens
    elastic, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper", **copy)
    stats = elastic.expert_stats  # the paper's rule evicts whenever pages run short (the cost rule: tests below)
    assert stats["evictions"] > 0 and stats["additions"] > 0 and stats["prefetch_misses"] > 0
    assert tokens == expected
    fixed, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=3, **copy)
    assert fixed.expert_stats["evictions"] == 0 and fixed.experts.num_offloaded > 0
    assert tokens == expected
    expect_no_growth(monkeypatch)  # admitted on today's pages, the batch outgrows the pool: preemption
    squeezed, tokens = run(folder, prompts, gpu_memory_budget=budget_for(folder, 24, 1), expert_offload_limit=1,
                           **copy)  # fmt: skip
    assert squeezed.scheduler.num_preemptions > 0 and squeezed.expert_stats["evictions"] > 0
    assert tokens == expected


@pytest.mark.parametrize("cuda_graphs", [False, True])  # True on CPU: the padded graph path, run eagerly
def test_direct_reads_change_speed_never_tokens(family, cuda_graphs, monkeypatch):
    """expert_reads="direct" (the default): routed host experts are read where they are, with no loading buffers
    and no hook."""
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    options = dict(expert_reads="direct", cuda_graphs=cuda_graphs)
    elastic, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, **options)
    stats = elastic.expert_stats
    assert stats["evictions"] > 0 and stats["direct_reads"] > 0 and stats["buffer_pages"] == 0
    assert stats["prefetch_hits"] + stats["prefetch_misses"] == 0  # nothing copied on demand or ahead
    assert tokens == expected
    fixed, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=3,
                        **options)  # fmt: skip
    assert fixed.expert_stats["direct_reads"] > 0 and fixed.experts.num_offloaded > 0
    assert tokens == expected
    expect_no_growth(monkeypatch)
    squeezed, tokens = run(folder, prompts, gpu_memory_budget=budget_for(folder, 24, 0), expert_offload_limit=1,
                           **options)  # fmt: skip
    assert squeezed.scheduler.num_preemptions > 0 and squeezed.expert_stats["evictions"] > 0
    assert tokens == expected


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_direct_reads_count_each_routed_host_expert_once_a_layer_pass(family, cuda_graphs):
    """The reads counted after each pass (`RoutingCounter.count_kept`, all layers at once) are what an observer sees
    during it: for every layer, the routed experts that were on the host then."""
    folder, prompts, expected = family
    seen = []

    def prepare(engine):
        store = engine.experts
        engine.expert_manager.counter.observers.append(
            lambda layer, hidden, ids: seen.append(len(set(ids.flatten().tolist()) & store.offloaded[layer])))

    budget = budget_for(folder, kv_tokens=60, offload=3)
    engine, tokens = run(folder, prompts, prepare, gpu_memory_budget=budget, expert_offload_limit=3,
                         expert_reads="direct", cuda_graphs=cuda_graphs)  # fmt: skip
    assert tokens == expected and engine.expert_stats["evictions"] > 0
    assert engine.expert_manager.direct_reads() == sum(seen) > 0


def test_prefetch_predicts_some_experts(family):
    folder, prompts, expected = family
    engine, tokens = run(folder, prompts, gpu_memory_budget=budget_for(folder, 60, 4), expert_policy="fixed",
                         offload_per_layer=4, expert_reads="copy")  # fmt: skip
    assert tokens == expected
    if len(engine.experts.layer_ids) > 1:
        assert engine.expert_stats["prefetched"] > 0 and engine.expert_stats["prefetch_hits"] > 0


def test_the_copier_makes_page_views_only_for_pages_it_copies():
    """A small model on a big card has millions of expert pages; the copier must not make a view of each up front
    (`unbind` did: 1.6 s and about 600 MB of host memory a million pages on the development CPU, at every start)."""
    view = torch.zeros(1_000_000, 4)
    copier = ExpertCopier(view)
    matrices = [torch.full((2, 2), float(i)) for i in (1, 2, 3)]
    copier.copy([7, 999_999, 3], matrices)
    assert view[7].tolist() == [1.0] * 4 and view[999_999].tolist() == [2.0] * 4 and view[3].tolist() == [3.0] * 4
    assert view.sum() == 4 * (1 + 2 + 3) and len(copier._pages) == 3


class DeferredCopier(ExpertCopier):
    """Side-stream copies land only when waited for, as on a GPU whose copy is still in flight; like one CUDA
    stream, waiting for a copy completes every copy queued before it."""

    def __init__(self, expert_view):
        super().__init__(expert_view)
        self.in_flight: dict[int, tuple] = {}
        self.pending_pages: set[int] = set()

    def copy_many(self, experts, after=None, side_stream=True):
        if not side_stream or not experts:
            return super().copy_many(experts, after, side_stream)
        self.issued = ticket = getattr(self, "issued", 0) + 1
        self.in_flight[ticket] = experts
        self.pending_pages.update(page for page_ids, _ in experts for page in page_ids)
        return ticket

    def wait(self, ticket):
        for earlier in sorted(t for t in self.in_flight if ticket is not None and t <= ticket):
            for page_ids, matrices in self.in_flight.pop(earlier):
                self._copy(page_ids, matrices)
                self.pending_pages.difference_update(page_ids)


@pytest.mark.parametrize("adjuster", ["paper", "cost"])
def test_tables_never_point_at_unfinished_copies_or_reclaimed_pages(family, adjuster):
    folder, prompts, expected = family
    llm = LLM(folder, progress=False, gpu_memory_budget=budget_for(folder, 60, 3), expert_offload_limit=3,
              adjuster=adjuster, expert_reads="copy")  # fmt: skip
    engine = llm.engine
    if adjuster == "cost":  # copies free, growth quick, eager swaps (whatever they save): it evicts, adds, swaps
        engine.adjuster.cost.pin(bandwidth=1e15, compute_s=1.0)
        engine.adjuster.refresh_every = 1  # a swap is weighed after each flush: every round, not one in 8 of ~20
        engine.adjuster.thresholds = replace(engine.adjuster.thresholds, grow_after_rounds=2, readd_after_rounds=4,
                                             swap_margin=0.5, swap_min_touch_gain=-1.0)  # fmt: skip
    store, loader, allocator = engine.experts, engine.expert_manager.loader, engine.allocator
    copier = store.copier = loader.copier = loader.changes.copier = DeferredCopier(store.expert_view)
    publish, on_routing = store.publish, loader.on_routing
    checked = []

    def checked_publish(layer, expert, page_ids):
        assert not copier.pending_pages & set(page_ids), "page table published before the copy finished"
        publish(layer, expert, page_ids)

    def checked_routing(layer, hidden, topk_ids):
        prefetch = on_routing(layer, hidden, topk_ids)
        for expert in topk_ids.unique().tolist():
            pages = loader.working_tables[layer, expert].tolist()
            for page, matrix in zip(pages, store.host[layer].matrices(expert)):
                assert allocator.holder(page, EXPERT) is not None, f"layer {layer} reads page {page}: free or KV"
                assert page not in copier.pending_pages, f"layer {layer} reads page {page} before its copy"
                assert torch.equal(store.expert_view[page], matrix.reshape(-1)), f"page {page} holds another expert"
        in_buffers = sorted(set(topk_ids.unique().tolist()) & store.offloaded[layer])
        same = torch.ones(store.num_experts, dtype=torch.bool)
        same[in_buffers] = False  # every other entry of the working row is the store's, never a stale copy
        assert torch.equal(loader.working_tables[layer][same], store.page_tables[layer][same]), f"layer {layer} stale"
        checked.append(layer)
        return prefetch

    store.publish, loader.on_routing = checked_publish, checked_routing
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert checked and engine.expert_stats["evictions"] > 0 and engine.expert_stats["additions"] > 0
    assert engine.expert_stats["swaps"] > 0 or adjuster == "paper"
    assert copier.issued > 0  # side-stream copies really were deferred


def test_bad_offload_settings_fail_at_start_with_the_numbers(family):
    folder = family[0]
    with pytest.raises(ValueError, match=r"expert_offload_limit must be in \[0, 8\].*got 9"):
        LLM(folder, progress=False, expert_offload_limit=9)
    small = budget_for(folder, 0, 0) - 40 * 8192
    copies = dict(progress=False, expert_offload_limit=2, expert_reads="copy")
    with pytest.raises(ValueError, match=r"loading buffers of 2 experts .* GiB needed") as refused:
        LLM(folder, gpu_memory_budget=small, **copies)
    assert LLM(folder, gpu_memory_budget=smallest_budget(refused), **copies).engine.pool.num_bytes > 0


def smallest_budget(refused: pytest.ExceptionInfo) -> str:
    """The budget a refusal names ('... to at least 12.6MiB ...'), as the user would type it back."""
    return re.search(r"at least (\S+?[KMG]iB)", str(refused.value)).group(1)


def test_resident_refuses_a_budget_that_cannot_hold_the_experts(family):
    """The refusal names the smallest budget that holds every expert, and that budget starts."""
    folder = family[0]
    with pytest.raises(ValueError, match=r"every expert resident needs a pool .* GiB short") as refused:
        LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=budget_for(folder, 0, 0) - 10 * 8192)
    engine = LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=smallest_budget(refused)).engine
    assert engine.experts.num_offloaded == 0


def test_a_pool_too_small_for_max_model_len_lowers_it_or_refuses(family, caplog):
    folder = family[0]
    budget = budget_for(folder, kv_tokens=48, offload=0)
    with pytest.raises(ValueError, match=r"max_model_len 256 needs KV cache for 256 tokens .* pool holds 48") as no:
        LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=budget, max_model_len=256)
    enough = LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=smallest_budget(no),
                 max_model_len=256).engine  # fmt: skip
    assert enough.config.max_model_len == 256
    engine = LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=budget).engine
    assert engine.config.max_model_len == 48 and "max_model_len lowered from 512" in caplog.text


@pytest.mark.parametrize("shortfall_pages", [3, 4])  # a whole expert short, and a whole one and a page
def test_elastic_starts_when_the_experts_do_not_fit(family, shortfall_pages):
    """The start-up placement offloads the coldest experts until the rest fits with a KV page to spare: the CUDA
    graphs' padding rows take one at start (an exact fit left none), and the tokens stay Hugging Face's."""
    folder, prompts, expected = family
    page = LLM(folder, progress=False, expert_policy="resident").engine.pool.sizes.expert_page_bytes
    free_gpu_memory()
    budget = budget_for(folder, kv_tokens=0, offload=2) - shortfall_pages * page
    engine, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=2, cuda_graphs=True)
    assert engine.runner.graphs is not None and engine.experts.num_offloaded >= 1
    assert tokens == expected


@pytest.mark.parametrize("reads", ["direct", "copy"])
def test_the_default_policy_starts_wherever_a_fixed_offload_would(family, reads):
    """A budget sweep down to every routed expert on the host: with no policy flags the engine starts at each budget
    a fixed offload of that many experts a layer starts at (the least the budget requires goes to the host), and
    its greedy tokens are Hugging Face's. A cap of a quarter of a layer (2 of 8) used to refuse below that."""
    folder, prompts, expected = family
    engine = LLM(folder, progress=False, expert_policy="resident").engine
    expert_bytes, layers = 3 * engine.pool.sizes.expert_page_bytes, len(engine.experts.layer_ids)
    del engine
    for offload in (0, 3, 6, 8):
        buffers = offload if reads == "copy" else 0  # direct reads need no loading buffers
        budget = budget_for(folder, kv_tokens=60, offload=buffers) - offload * layers * expert_bytes
        fixed, tokens = run(folder, prompts[:2], gpu_memory_budget=budget, expert_policy="fixed",
                            offload_per_layer=offload, expert_reads=reads)  # fmt: skip
        assert tokens == expected[:2]
        default, tokens = run(folder, prompts[:2], gpu_memory_budget=budget, expert_reads=reads)
        assert tokens == expected[:2]
        if reads == "direct":  # the least the budget requires: no more than the fixed offload, within a layer's
            assert (offload - 1) * layers <= default.experts.num_offloaded <= offload * layers
