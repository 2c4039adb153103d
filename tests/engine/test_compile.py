"""`compile=True`: the engine's forward pass through torch.compile (inductor's C++ backend on the CPU) gives Hugging
Face's greedy tokens, all experts resident and under the elastic pool with copy-mode reads (whose routing hook is
a graph break a MoE layer), on the padded graph path too; a compile that fails falls back to the eager pass."""

import logging

import pytest
import torch
import torch._dynamo

from rimuru.models import fabricate
from tests.engine.conftest import assert_greedy_close, make_prompts
from tests.engine.test_experts import budget_for, run
from tests.engine.test_step_graphs import stand_in_cuda_graphs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each engine compiles its own model: no cache entries or recompile counts carried over
    yield
    torch._dynamo.reset()


def test_compiled_engine_gives_hugging_face_tokens(family):
    folder, prompts, expected = family
    resident, tokens = run(folder, prompts, expert_policy="resident", compile=True, cuda_graphs=True)
    assert tokens == expected and resident.runner.num_graph_steps > 0
    assert resident.loaded.model.forward.num_calls > 0 and not resident.loaded.model.forward.failed
    budget = budget_for(folder, kv_tokens=60, offload=3)
    elastic, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper",
                          expert_reads="copy", compile=True)  # fmt: skip
    assert tokens == expected and elastic.expert_stats["evictions"] > 0
    assert not elastic.loaded.model.forward.failed


@pytest.mark.parametrize("policy", ["resident", "elastic"])
def test_no_compile_runs_inside_a_capture(family, monkeypatch, policy):
    """Each shape's warm-up calls the compiled pass as its capture will (the capture's routing hook included, where
    the policy may copy experts mid-pass), so dynamo compiles nothing inside a capture, where it would invalidate
    the graph on a GPU; all experts resident, the pass is one graph with no break. Stand-in graphs on the CPU,
    dynamo's graphs counted by a backend that runs them as they are."""
    compiles, in_capture = [], []

    def counting_backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    monkeypatch.setattr("rimuru.compilation.BACKEND", counting_backend)
    torch._dynamo.utils.counters.clear()  # graph breaks are counted process-wide
    folder, prompts, _ = family
    engine, _ = run(folder, prompts[:1], expert_policy=policy, compile=True, cuda_graphs=True, max_num_seqs=4,
                    max_num_batched_tokens=64)  # fmt: skip
    graphs = engine.runner.graphs
    stand_in_cuda_graphs(monkeypatch)
    original = type(graphs)._capture

    def counted(self, shape, pool):
        before = len(compiles)
        captured = original(self, shape, pool)
        in_capture.append(len(compiles) - before)
        return captured

    monkeypatch.setattr(type(graphs), "_capture", counted)
    graphs.capture = True
    before = len(compiles)
    graphs.capture_all(progress=False)
    assert len(compiles) > before  # the warm-ups compiled the pass with the capture's hook
    assert len(in_capture) == len(graphs.shapes) and not any(in_capture)
    assert graphs.cut_at_routing == (policy != "resident")
    assert bool(torch._dynamo.utils.counters["graph_break"]) == graphs.cut_at_routing


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # its q/k norms: the most fusions
def test_inductor_fusions_give_hugging_face_tokens(family, monkeypatch):
    """RIMURU_INDUCTOR_FUSIONS: the norms, RoPE, activations and router top-k traced as their torch references for
    inductor to fuse, in place of Rimuru's kernels, change no token."""
    monkeypatch.setattr("rimuru.ops.INDUCTOR_FUSIONS", True)
    traced = []

    def counting_backend(graph, example_inputs):
        traced.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return torch._inductor.compile(graph, example_inputs)

    monkeypatch.setattr("rimuru.compilation.BACKEND", counting_backend)
    folder, prompts, expected = family
    engine, tokens = run(folder, prompts, expert_policy="resident", compile=True, cuda_graphs=True)
    assert tokens == expected and not engine.loaded.model.forward.failed
    assert traced and torch.ops.rimuru.rms_norm.default not in traced
    assert torch.ops.rimuru.add_rms_norm.default not in traced


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)  # a failure path: one family says it
def test_a_failed_compile_runs_the_eager_pass(family, monkeypatch, caplog):
    folder, prompts, expected = family

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("rimuru.compilation.BACKEND", failing_backend)
    with caplog.at_level(logging.WARNING, logger="rimuru.compilation"):
        engine, tokens = run(folder, prompts, expert_policy="resident", compile=True)
    assert tokens == expected and engine.loaded.model.forward.failed
    assert any("runs eagerly" in r.getMessage() for r in caplog.records)


def test_compiled_hybrid_gives_the_eager_tokens(tmp_path):
    """Qwen3-Next: the linear layers' state ops inside the compiled pass (every pool view fp32 on the CPU)."""
    folder = fabricate(tmp_path, arch="qwen3_next")
    prompts = make_prompts(512)
    _, eager = run(folder, prompts, expert_policy="resident", cuda_graphs=True)
    compiled, tokens = run(folder, prompts, expert_policy="resident", cuda_graphs=True, compile=True)
    assert tokens == eager and not compiled.loaded.model.forward.failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_pass_in_captured_graphs_gives_hugging_face_tokens_on_gpu(family):
    """fp32 on the GPU: inductor's kernels between the Triton ops, captured in the decode and mixed graphs."""
    folder, prompts, expected = family
    options = dict(device="cuda", dtype=torch.float32, compile=True)
    resident, tokens = run(folder, prompts, expert_policy="resident", **options)
    assert_greedy_close(folder, prompts, tokens, expected)
    assert resident.runner.num_graph_steps > 0 and not resident.loaded.model.forward.failed
    copy = dict(expert_reads="copy", **options)  # the budget sized with this engine's own measured reserve
    budget = budget_for(folder, kv_tokens=60, offload=3, expert_policy="elastic", **copy)
    elastic, elastic_tokens = run(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper",
                                  **copy)  # fmt: skip
    assert_greedy_close(folder, prompts, elastic_tokens, expected)
    assert elastic.expert_stats["evictions"] > 0 and not elastic.loaded.model.forward.failed


def test_compiled_bf16_hybrid_traces_its_fp32_delta_rule_without_a_graph_break(tmp_path):
    """Qwen3.5 in bf16 keeps its recurrent state in fp32 pages of the bf16 pool; the ops take those pages as a view
    in the pool's dtype and read them as fp32 inside (aot_autograd takes written views only in their base's dtype),
    so the pass compiles whole. Its tokens are not compared: inductor's bf16 reductions round unlike eager's (fp32
    passes are equal)."""
    folder = fabricate(tmp_path, arch="qwen3_5_moe")
    prompts = make_prompts(512)[:5]
    torch._dynamo.utils.counters.clear()
    compiled, tokens = run(folder, prompts, expert_policy="resident", cuda_graphs=True, dtype=torch.bfloat16,
                           compile=True)  # fmt: skip
    assert compiled.pool.ssm_view().dtype == torch.float32 != compiled.pool.kv_view().dtype
    assert not compiled.loaded.model.forward.failed and all(len(t) == len(tokens[0]) > 0 for t in tokens)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
