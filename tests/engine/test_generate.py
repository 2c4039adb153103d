"""The offline engine against Hugging Face transformers: same greedy tokens however the batch is formed.

Memory policy and budget change speed, never tokens: chunked prefill, a pool small enough to force preemption, and
a roomy pool all give Hugging Face's tokens.
"""

import weakref

import pytest

from rimuru import LLM, SamplingParams
from rimuru.preemption_cost import PreemptionCost
from tests.engine.conftest import MAX_TOKENS, expect_no_growth

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(folder: str, prompts, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(folder, progress=False, **options)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def tight_budget(folder: str, num_kv_tokens: int) -> int:
    """A budget whose pool holds every expert plus KV pages for about `num_kv_tokens` tokens in every layer."""
    engine = LLM(folder, progress=False, expert_policy="resident").engine
    plan, sizes, config = engine.memory_plan, engine.pool.sizes, engine.model_config
    expert_bytes = engine.experts.num_expert_pages * sizes.expert_page_bytes
    kv_pages = -(-num_kv_tokens // sizes.page_tokens) * config.num_hidden_layers
    kv_bytes = -(-kv_pages // sizes.kv_pages_per_expert_page) * sizes.expert_page_bytes
    engine.close()
    return plan.weights_bytes + plan.activation_bytes + expert_bytes + kv_bytes


def test_greedy_matches_hf(family):
    folder, prompts, expected = family
    _, tokens = generate(folder, prompts)
    assert tokens == expected


def test_chunked_prefill_of_seven_tokens_matches_hf(family):
    folder, prompts, expected = family
    llm, tokens = generate(folder, prompts, max_num_batched_tokens=7)
    assert tokens == expected
    assert llm.engine.num_steps > len(prompts) * MAX_TOKENS / 7  # it really ran in small chunks


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_keeps_tokens_identical(family, monkeypatch, preemption):
    """A forecast that expects no growth admits whatever fits today, so the batch outgrows the pool. A victim's KV
    copied to the host and back into other pages, or its prompt recomputed: the same tokens either way."""
    folder, prompts, expected = family
    longest = max(map(len, prompts)) + MAX_TOKENS
    expect_no_growth(monkeypatch)
    llm, tokens = generate(folder, prompts, gpu_memory_budget=tight_budget(folder, 2 * longest), expert_policy="resident",
                           preemption=preemption)  # fmt: skip
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.swap.num_saved > 0 and scheduler.swap.saved_bytes == 0) if preemption == "swap" else not scheduler.swap
    assert tokens == expected
    assert llm.engine.allocator.stats()["kv_used_pages"] == 0  # every page came back
    llm.engine.allocator.check_integrity()


def test_a_victim_is_recomputed_where_that_costs_less(family, monkeypatch):
    """Swap mode, with a link so slow that every victim's prompt costs less to recompute: none is saved."""
    folder, prompts, expected = family
    longest = max(map(len, prompts)) + MAX_TOKENS
    expect_no_growth(monkeypatch)
    llm = LLM(folder, progress=False, gpu_memory_budget=tight_budget(folder, 2 * longest), expert_policy="resident")
    llm.engine.scheduler.swap.cost = PreemptionCost(link_bytes_per_s=1.0, prefill_s_per_token=1e-9, weight=0.0)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.swap.num_saved == 0
    assert tokens == expected


def test_the_growth_forecast_admits_only_what_the_pool_carries_to_the_end(family):
    """The same tight pool: requests wait to be admitted instead of being preempted, and the tokens are the same."""
    folder, prompts, expected = family
    longest = max(map(len, prompts)) + MAX_TOKENS
    llm, tokens = generate(folder, prompts, gpu_memory_budget=tight_budget(folder, 2 * longest), expert_policy="resident")
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions == 0 and scheduler.num_refusals > 0
    assert tokens == expected


def test_requests_added_while_others_run_match_hf(family):
    folder, prompts, expected = family
    engine = LLM(folder, progress=False, max_num_seqs=3).engine
    done = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        for request in engine.step():
            if request.is_finished:
                done[request.request_id] = request.output_token_ids
    while engine.has_unfinished():
        done |= {r.request_id: r.output_token_ids for r in engine.step() if r.is_finished}
    assert [done[str(i)] for i in range(len(prompts))] == expected


def test_abort_frees_pages(family):
    folder, prompts, _ = family
    engine = LLM(folder, progress=False).engine
    free_before = engine.allocator.stats()["free_bytes"]
    engine.add_request("a", prompts[-1], GREEDY)
    engine.step()
    assert engine.allocator.stats()["kv_used_pages"] > 0
    engine.abort("a")
    assert engine.allocator.stats()["free_bytes"] == free_before
    while engine.has_unfinished():  # async scheduling: the pass launched for its next token, retired unread
        assert engine.step() == []
    assert engine.allocator.stats()["free_bytes"] == free_before


@pytest.mark.parametrize("policy", ["resident", "elastic"])
def test_close_gives_the_memory_back_and_refuses_more_work(family, policy):
    """After `close` nothing holds the pool or the weights (the engine's reference cycles included), and a new
    request or step says the engine is closed; `with LLM(...)` closes on leaving."""
    folder, prompts, expected = family
    with LLM(folder, progress=False, expert_policy=policy, cuda_graphs=True) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)]
        held = [weakref.ref(llm.engine.pool.data), weakref.ref(llm.engine.loaded.model)]
    assert tokens == expected[:2]
    assert [ref() for ref in held] == [None, None]
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.engine.step()
    assert not llm.engine.has_unfinished()
    llm.close()  # a second close does nothing
