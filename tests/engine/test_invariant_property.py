"""Property: whatever the policy, budget, chunk size, batch limit, adjuster, expert reads and scheduling (async or
not), greedy tokens equal Hugging Face's, every page comes back, and the allocator stays consistent."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rimuru import LLM
from tests.engine.test_experts import GREEDY, budget_for


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    policy=st.sampled_from(["elastic", "fixed", "resident"]),
    adjuster=st.sampled_from(["paper", "cost"]),
    kv_tokens=st.integers(64, 400),
    offload=st.integers(1, 4),
    chunk=st.sampled_from([5, 16, 64, 8192]),
    max_num_seqs=st.integers(1, 9),
    prefetch=st.booleans(),
    expert_reads=st.sampled_from(["copy", "direct"]),
    order=st.permutations(range(9)),
    async_scheduling=st.booleans(),
)
def test_tokens_never_depend_on_memory_settings(family, policy, adjuster, kv_tokens, offload, chunk, max_num_seqs,
                                                prefetch, expert_reads, order, async_scheduling):  # fmt: skip
    folder, prompts, expected = family
    options = dict(expert_policy=policy, adjuster=adjuster, max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs,
                   prefetch=prefetch, expert_reads=expert_reads, expert_offload_limit=offload, offload_per_layer=offload,
                   max_model_len=64, async_scheduling=async_scheduling)  # fmt: skip  (every prompt + output fits; the pool must hold one such sequence)
    budget = budget_for(folder, kv_tokens=kv_tokens, offload=offload if policy != "resident" else 0,
                        max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs)  # the same activation reserve
    llm = LLM(folder, progress=False, gpu_memory_budget=budget, **options)
    chosen = [prompts[i] for i in order]
    outputs = llm.generate(chosen, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[i] for i in order]
    engine = llm.engine
    engine.allocator.check_integrity()
    assert engine.allocator.stats()["kv_used_pages"] == 0 and not engine.has_unfinished()
