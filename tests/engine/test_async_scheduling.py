"""Async scheduling (a step launched before the tokens of the one before are read) changes no token: greedy and
seeded outputs, stops, logprobs, preemption and aborts the same as with every step read before the next."""

import pytest

from rimuru import LLM, SamplingParams
from rimuru.pending_tokens import PendingTokens
from tests.engine.conftest import MAX_TOKENS, expect_no_growth
from tests.engine.test_generate import GREEDY, tight_budget


def mixed_params(expected: list[list[int]]) -> list[SamplingParams]:
    """A request per prompt, of every kind whose tokens a deferred read could disturb: stop ids met early (the next
    step already runs them), stop strings, seeded sampling, n = 2, short max_tokens, logprobs (read with the
    tokens)."""
    kinds = [
        lambda e: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[e[3]]),
        lambda e: SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda e: SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        lambda e: SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
        lambda e: SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=MAX_TOKENS, ignore_eos=True),
        lambda e: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=["a"]),
        lambda e: GREEDY,
    ]
    return [kinds[i % len(kinds)](e) for i, e in enumerate(expected)]


def outputs(folder, prompts, params, **options) -> list[tuple]:
    with LLM(folder, progress=False, expert_policy="resident", **options) as llm:
        engine = llm.engine
        held = engine.allocator.stats()["kv_used_pages"]  # the CUDA graphs' scratch page, on a GPU
        results = llm.generate(prompts, params, use_tqdm=False)
        assert engine.allocator.stats()["kv_used_pages"] == held and not engine.has_unfinished()
        engine.allocator.check_integrity()
        return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in r.outputs] for r in results], \
            engine.num_steps


def assert_same_outputs(deferred: list, at_once: list) -> None:
    """Tokens, finish and stop reasons equal; logprobs the same tokens, values to the rounding (a step's batch can
    differ by a request that one of them ran a step longer, and the logits' GEMM rounds by its row count)."""
    assert [[c[:3] for c in r] for r in deferred] == [[c[:3] for c in r] for r in at_once]
    for one, other in zip((c[3] for r in deferred for c in r), (c[3] for r in at_once for c in r)):
        assert (one is None) == (other is None)
        for a, b in zip(one or [], other or []):
            assert list(a) == list(b) and all(abs(a[t] - b[t]) < 1e-5 for t in a)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7, "max_num_seqs": 3}], ids=["whole", "chunked"])
def test_deferred_reads_give_the_same_outputs(family, monkeypatch, options):
    folder, prompts, expected = family
    params = mixed_params(expected)
    reads = []
    monkeypatch.setattr(PendingTokens, "wait", lambda self, wait=PendingTokens.wait: reads.append(1) or wait(self))
    deferred, steps = outputs(folder, prompts, params, async_scheduling=True, **options)
    assert len(reads) == steps  # every step's tokens were read a step late
    reads.clear()
    at_once = outputs(folder, prompts, params, async_scheduling=False, **options)[0]
    assert not reads
    assert_same_outputs(deferred, at_once)
    greedy = [i for i, p in enumerate(params) if p is GREEDY]
    assert greedy and all(deferred[i][0][0] == expected[i] for i in greedy)  # Hugging Face's tokens


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_with_a_token_in_flight_keeps_hf_tokens(family, monkeypatch, preemption):
    """Victims chosen while their last token is still on the device: saved or recomputed, Hugging Face's tokens."""
    folder, prompts, expected = family
    expect_no_growth(monkeypatch)
    budget = tight_budget(folder, 2 * (max(map(len, prompts)) + MAX_TOKENS))
    llm = LLM(folder, progress=False, expert_policy="resident", gpu_memory_budget=budget, preemption=preemption)
    assert llm.engine.async_scheduling
    held = llm.engine.allocator.stats()["kv_used_pages"]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and tokens == expected
    assert llm.engine.allocator.stats()["kv_used_pages"] == held


def test_an_abort_while_its_token_is_in_flight_frees_everything(family):
    folder, prompts, expected = family
    engine = LLM(folder, progress=False, expert_policy="resident").engine
    held = engine.allocator.stats()["kv_used_pages"]
    engine.add_request("kept", prompts[0], GREEDY)
    engine.add_request("dropped", prompts[1], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.in_flight is not None and "dropped" in engine.in_flight.row_of
    engine.abort("dropped")
    done = {}
    while engine.has_unfinished():
        done |= {r.request_id: list(r.output_token_ids) for r in engine.step() if r.is_finished}
    assert done == {"kept": expected[0]}
    assert engine.allocator.stats()["kv_used_pages"] == held


def test_async_scheduling_is_on_under_every_policy_unless_turned_off(family):
    def scheduled_async(**options) -> bool:
        with LLM(family[0], progress=False, **options) as llm:
            return llm.engine.async_scheduling

    assert all(scheduled_async(expert_policy=policy) for policy in ("elastic", "fixed", "resident"))
    assert not scheduled_async(expert_policy="elastic", async_scheduling=False)
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        LLM(family[0], progress=False, async_scheduling=True, tensor_parallel_size=2)


@pytest.mark.parametrize("expert_reads", ["copy", "direct"])
def test_the_elastic_pool_under_async_scheduling_keeps_hf_tokens(family, expert_reads):
    """Asked for, with the elastic pool evicting and bringing experts back (the paper's rule, a tight budget): the
    additions' copies wait for the passes still queued, whose KV writes may land in the pages they take."""
    from tests.engine.test_experts import budget_for, run

    folder, prompts, expected = family
    engine, tokens = run(folder, prompts, gpu_memory_budget=budget_for(folder, kv_tokens=60, offload=3),
                         expert_offload_limit=3, adjuster="paper", expert_reads=expert_reads, async_scheduling=True)
    assert engine.async_scheduling and engine.expert_stats["evictions"] > 0 and engine.expert_stats["additions"] > 0
    assert tokens == expected
