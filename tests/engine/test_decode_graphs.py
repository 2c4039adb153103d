"""Decode steps as CUDA graphs (`rimuru.decode_graphs`): the padded, static-buffer path gives the same tokens as the
eager one, under every memory policy, and the routing hook never sees a padding row.

On CPU `cuda_graphs=True` runs the very same padded path without capturing; the GPU test captures and replays."""

import pytest
import torch

from rimuru import LLM
from rimuru.decode_graphs import graph_batch_sizes
from tests.engine.conftest import NUM_PROMPTS, free_gpu_memory
from tests.engine.test_experts import GREEDY, budget_for, run


def test_graph_batch_sizes_follow_vllms_and_end_at_the_limit():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(4096)[-1] == 512


def record_hook_rows(engine) -> list[tuple[int, int]]:
    """(rows the hook saw, requests in the step) for every routing of every graph step."""
    seen, manager, runner = [], engine.expert_manager, engine.runner
    hook, run_graph = manager.on_routing, runner.graphs.run

    def on_routing(layer, hidden, topk_ids):
        if current[0] is not None:  # eager (prefill) passes call the hook too
            seen.append((hidden.shape[0], topk_ids.shape[0], current[0]))
        return hook(layer, hidden, topk_ids)

    def run(inputs, on_routing_):
        assert torch.equal(engine.kv_cache.device_tables, engine.kv_cache.tables)  # the copy the graphs gather from
        current[0] = len(inputs.seq_lens)
        try:
            return run_graph(inputs, on_routing_)
        finally:
            current[0] = None

    current = [None]
    manager.on_routing, runner.graphs.run = on_routing, run
    return seen


@pytest.mark.parametrize("policy", ["elastic", "fixed"])
def test_padded_graph_path_changes_speed_never_tokens(family, policy):
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    options = dict(gpu_memory_budget=budget, expert_policy=policy, expert_offload_limit=3, offload_per_layer=3)
    seen = []
    engine, tokens = run(folder, prompts, prepare=lambda e: seen.append(record_hook_rows(e)), cuda_graphs=True,
                         **options)  # fmt: skip
    assert tokens == expected
    assert engine.runner.num_graph_steps > 0
    rows = seen[0]
    assert rows and all(hidden == ids == batch for hidden, ids, batch in rows)  # padding never reaches the hook
    sizes = engine.runner.graphs.batch_sizes
    assert any(batch not in sizes for *_, batch in rows)  # some steps were padded (9 prompts -> a batch of 16)
    assert engine.expert_stats["prefetch_misses"] > 0 and engine.experts.num_offloaded > 0
    assert engine.allocator.pages_of("decode-graphs", "kv") == [engine.runner.graphs.scratch_page]


def test_replays_issue_the_hooks_prefetch_after_queueing_the_next_piece(family):
    """Under captured graphs a hook's returned prefetch runs right after the next replay, before the next hook, so
    the GPU computes while the host issues the copies; nothing is dropped at the end of a pass."""
    from rimuru.decode_graphs import _Captured
    from rimuru.model_runner import StepInputs
    from rimuru.models.pieces import RoutingPoint

    folder, prompts, _ = family
    engine, _ = run(folder, prompts[:1], cuda_graphs=True)
    graphs, events = engine.runner.graphs, []

    class Graph:
        def __init__(self, index):
            self.index = index

        def replay(self):
            events.append(("replay", self.index))

    size, num_pieces = graphs.batch_sizes[0], 3
    points = [RoutingPoint(i, torch.zeros(size, 4), torch.zeros(size, 2, dtype=torch.int64)) for i in range(2)]
    graphs.capture, graphs.logits = True, torch.zeros(size, 5)
    graphs.captured[size] = _Captured([Graph(i) for i in range(num_pieces)], points)

    def hook(layer, hidden, topk_ids):
        events.append(("hook", layer))
        return lambda: events.append(("prefetch", layer))

    one = torch.zeros(1, dtype=torch.int64)
    inputs = StepInputs(one, one, one, torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                        one, [0])  # fmt: skip
    graphs.run(inputs, hook)
    assert events == [("replay", 0), ("hook", 0), ("replay", 1), ("prefetch", 0), ("hook", 1), ("replay", 2),
                      ("prefetch", 1)]  # fmt: skip


def test_cpu_runs_eagerly_unless_asked(family):
    folder, prompts, expected = family
    engine, tokens = run(folder, prompts[:2])
    assert engine.runner.graphs is None and engine.runner.num_graph_steps == 0
    assert not engine.allocator.owns("decode-graphs")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy,reads", [("resident", "copy"), ("fixed", "copy"), ("fixed", "direct")])
def test_captured_graphs_give_the_eager_tokens_on_gpu(family, policy, reads):
    """8 prompts decode as one batch of 8, a captured size, so graph and eager run the same kernels and tiles;
    direct reads (the kernels reading pinned host memory) give the copies' tokens too."""
    folder, prompts, _ = family
    prompts = prompts[:8]
    assert NUM_PROMPTS >= 8
    options = dict(device="cuda", dtype=torch.float32, expert_policy=policy, offload_per_layer=3)
    if policy == "fixed":
        options["gpu_memory_budget"] = budget_for(folder, kv_tokens=400, offload=3) + 2**30
    outputs = {}
    for graphs, expert_reads in ((False, "copy"), (True, reads), (False, reads)):
        llm = None
        free_gpu_memory()  # the previous engine's memory, before the next one plans its own
        llm = LLM(folder, progress=False, cuda_graphs=graphs, expert_reads=expert_reads, **options)
        outputs[graphs, expert_reads] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert (llm.engine.runner.num_graph_steps > 0) == graphs
        stats = llm.engine.expert_stats
        if policy == "fixed":  # host experts were reached, in place or through the loading buffers
            copied = stats["prefetch_hits"] + stats["prefetch_misses"]
            reached = copied if expert_reads == "copy" else stats["direct_reads"]
            assert reached > 0
    assert outputs[True, reads] == outputs[False, "copy"] == outputs[False, reads]


def test_a_failed_capture_falls_back_to_eager_unless_graphs_were_asked_for(family, monkeypatch, caplog):
    import rimuru.decode_graphs
    import rimuru.engine

    folder, prompts, expected = family

    def broken(self, progress=False):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(rimuru.decode_graphs.DecodeGraphs, "capture_all", broken)
    monkeypatch.setattr(rimuru.engine, "graphs_wanted", lambda cuda_graphs, device: True)  # a GPU's default
    engine, tokens = run(folder, prompts[:3])
    assert engine.runner.graphs is None and "every step runs eagerly" in caplog.text
    assert not engine.allocator.owns("decode-graphs")
    assert tokens == expected[:3]
    with pytest.raises(RuntimeError, match="stream is capturing"):
        LLM(folder, progress=False, cuda_graphs=True)
