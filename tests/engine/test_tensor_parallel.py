"""Tensor parallelism in the engine (`rimuru.tensor_parallel`): two gloo ranks on the CPU, rank 0 the engine and
rank 1 a worker process, give Hugging Face's greedy tokens with every expert resident, with a fixed offload and
under the elastic pool on a tight budget, and through preemption; a rank that dies fails the next step in one line."""

import os
import signal
import time

import pytest
import torch
import transformers

from rimuru import LLM
from rimuru.models import fabricate
from rimuru.tensor_parallel import expert_page_mismatches
from tests.engine.conftest import MAX_TOKENS, expect_no_growth, hf_greedy, make_prompts
from tests.engine.test_experts import GREEDY, budget_for
from tests.engine.test_hybrid import hybrid_budget

TP = dict(tensor_parallel_size=2)


def generate(folder, prompts, **options):
    """(the engine's expert stats with its offloaded experts and preemptions, greedy tokens), the engine closed."""
    with LLM(folder, progress=False, **TP, **options) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        engine = llm.engine
        engine.allocator.check_integrity()
        engine.check_rank_tables()  # after the run's evictions and additions: rank 1's pages and mirrors agree
        facts = engine.expert_stats | {"offloaded": engine.experts.num_offloaded,
                                       "preemptions": engine.scheduler.num_preemptions,
                                       "swapped": engine.scheduler.swap.num_saved if engine.scheduler.swap else 0,
                                       "graph_steps": engine.runner.num_graph_steps}  # fmt: skip
    return facts, tokens


def test_two_ranks_give_hugging_faces_tokens_under_every_policy(family, monkeypatch):
    folder, prompts, expected = family
    _, tokens = generate(folder, prompts, expert_policy="resident")
    assert tokens == expected
    budget = budget_for(folder, kv_tokens=60, offload=3, **TP)  # a rank's budget: its pool holds its slices
    elastic, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper")
    assert tokens == expected and elastic["evictions"] > 0 and elastic["additions"] > 0
    fixed, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=3)
    assert tokens == expected and fixed["offloaded"] > 0
    expect_no_growth(monkeypatch)
    squeezed, tokens = generate(folder, prompts, gpu_memory_budget=budget_for(folder, 24, 0, **TP),
                                expert_offload_limit=1)  # fmt: skip
    assert tokens == expected and squeezed["preemptions"] > 0 and squeezed["swapped"] > 0  # each rank's KV saved


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)  # its shared expert and dense layer too
def test_two_ranks_replay_the_step_graphs(family, monkeypatch):
    """cuda_graphs on the CPU (the graph path over the static, padded buffers): each rank replays the same captured
    shape from mirrors of rank 0's KV and expert tables, the table rows synced and the expert copies made since the
    last step coming in the step's message; Hugging Face's tokens under the elastic pool and through preemption."""
    folder, prompts, expected = family
    graphs = dict(cuda_graphs=True, max_num_seqs=8)
    budget = budget_for(folder, kv_tokens=60, offload=3, **TP, **graphs)
    elastic, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper",
                               **graphs)  # fmt: skip
    assert tokens == expected and elastic["evictions"] > 0 and elastic["graph_steps"] > 0
    expect_no_growth(monkeypatch)
    squeezed, tokens = generate(folder, prompts, gpu_memory_budget=budget_for(folder, 24, 0, **TP, **graphs),
                                expert_offload_limit=1, **graphs)  # fmt: skip
    assert tokens == expected and squeezed["swapped"] > 0 and squeezed["graph_steps"] > 0


def test_two_ranks_replay_the_compiled_pass(tmp_path):
    """compile=True on two ranks (each compiles its shard's pass, the all-reduces traced as functional collectives),
    replayed on the graph path: Hugging Face's tokens."""
    folder = fabricate(tmp_path / "qwen3_moe", arch="qwen3_moe")
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(folder).vocab_size)
    with LLM(folder, progress=False, expert_policy="resident", compile=True, cuda_graphs=True, max_num_seqs=8,
             **TP) as llm:  # fmt: skip
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        compiled = llm.engine.loaded.model.forward
        assert not compiled.failed and compiled.num_calls > 0 and llm.engine.runner.num_graph_steps > 0
    assert tokens == hf_greedy(folder, prompts, MAX_TOKENS)


def test_the_page_check_names_an_expert_page_a_rank_did_not_copy():
    tables = torch.full((2, 3, 3), -1, dtype=torch.int32)
    tables[1, 2] = torch.tensor([7, 8, 9])  # layer 1's expert 2 in pages 7-9 on rank 0
    assert expert_page_mismatches(tables, dict.fromkeys([7, 8, 9], (1, 2))) == []
    owners = dict.fromkeys([7, 8], (1, 2)) | {9: (0, 1)}  # the rank's last copy into page 9 was another expert's
    assert expert_page_mismatches(tables, owners) == ["page 9 holds (0, 1) here, expert (1, 2) on rank 0"]


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # a failure path: one family says it
def test_a_rank_that_dies_fails_the_next_step_in_one_line(family):
    folder, prompts, _ = family
    llm = LLM(folder, progress=False, **TP)
    worker = llm.engine.workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match="^tensor parallel: rank 1 \\(exit code -9\\) stopped answering"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    llm.engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # a failure path: one family says it
def test_what_tensor_parallelism_cannot_do_yet_is_refused_in_one_line(family, monkeypatch):
    folder = family[0]
    with pytest.raises(ValueError, match="^tensor_parallel_size 2 reads host experts in place only"):
        LLM(folder, progress=False, expert_reads="copy", **TP)
    with monkeypatch.context() as patched:  # refused before any rank starts (each would print its traceback)
        patched.setattr("rimuru.engine.start_workers", lambda *args: pytest.fail("a rank was started"))
        with pytest.raises(ValueError, match="^tensor_parallel_size 3 does not divide num_attention_heads"):
            LLM(folder, progress=False, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="^gpu_memory_budget"):  # refused after the other ranks started
        LLM(folder, progress=False, gpu_memory_budget="64KiB", **TP)
    LLM(folder, progress=False, **TP).close()  # which left no rank and no process group behind


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # a failure path: one family says it
def test_a_rank_that_hangs_fails_the_next_step_within_the_timeout(family, monkeypatch):
    """A stopped worker (SIGSTOP: alive, answering nothing) makes the step fail after $RIMURU_TP_TIMEOUT_S."""
    folder, prompts, _ = family
    monkeypatch.setenv("RIMURU_TP_TIMEOUT_S", "5")
    llm = LLM(folder, progress=False, **TP)
    worker = llm.engine.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="^tensor parallel: a rank stopped answering"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 60
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.engine.close()


def test_two_ranks_serve_a_hybrid_model_with_its_state_split_by_head(tmp_path, monkeypatch):
    """Qwen3-Next on two ranks: each holds its linear-attention heads' state pages; Hugging Face's tokens with all
    experts resident (steps replayed) and through preemption (every rank's state saved with its KV, or rebuilt)."""
    folder = fabricate(tmp_path / "qwen3_next", arch="qwen3_next")
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(folder).vocab_size)
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    replayed, tokens = generate(folder, prompts, expert_policy="resident", cuda_graphs=True, max_num_seqs=8)
    assert tokens == expected and replayed["graph_steps"] > 0  # every rank's state tables in the step's inputs
    expect_no_growth(monkeypatch)
    for preemption in ("swap", "recompute"):
        squeezed, tokens = generate(folder, prompts, gpu_memory_budget=hybrid_budget(folder, 48, 2, 0, **TP),
                                    expert_policy="resident", preemption=preemption)  # fmt: skip
        assert tokens == expected and squeezed["preemptions"] > 0
        assert (squeezed["swapped"] > 0) == (preemption == "swap")
