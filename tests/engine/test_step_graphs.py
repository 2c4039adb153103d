"""Steps as CUDA graphs (`rimuru.step_graphs`): the padded, static-buffer path gives the same tokens as the
eager one, under every memory policy, and the routing hook never sees a padding row.

On CPU `cuda_graphs=True` runs the very same padded path without capturing; the GPU test captures and replays."""

import re

import pytest
import torch

from rimuru import LLM
from rimuru.config import EngineConfig
from rimuru.step_graphs import Shape, graph_batch_sizes, graph_limits, mixed_token_sizes
from tests.engine.conftest import NUM_PROMPTS, free_gpu_memory, pin_step_reserve
from tests.engine.test_experts import GREEDY, budget_for, run


def test_graph_batch_sizes_follow_vllms_and_end_at_the_limit():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256 and len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(4096)[-1] == 512


def record_hook_rows(engine) -> list[tuple[int, int]]:
    """(rows the hook saw, requests in the step) for every routing of every graph step."""
    seen, loader, runner = [], engine.expert_manager.loader, engine.runner
    hook, run_graph = loader.on_routing, runner.graphs.run

    def on_routing(layer, hidden, topk_ids):
        if current[0] is not None:  # eager (prefill) passes call the hook too
            seen.append((hidden.shape[0], topk_ids.shape[0], current[0]))
        return hook(layer, hidden, topk_ids)

    def run(inputs, on_routing_, shape):
        assert torch.equal(engine.kv_cache.device_tables, engine.kv_cache.tables)  # the copy the graphs gather from
        current[0] = len(inputs.seq_lens)
        try:
            return run_graph(inputs, on_routing_, shape)
        finally:
            current[0] = None

    current = [None]
    loader.on_routing, runner.graphs.run = on_routing, run
    return seen


@pytest.mark.parametrize("policy", ["elastic", "fixed"])
def test_padded_graph_path_changes_speed_never_tokens(family, policy):
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    options = dict(gpu_memory_budget=budget, expert_policy=policy, expert_offload_limit=3, offload_per_layer=3,
                   expert_reads="copy")  # the hook's path; direct reads run no hook  # fmt: skip
    seen = []
    engine, tokens = run(folder, prompts, prepare=lambda e: seen.append(record_hook_rows(e)), cuda_graphs=True,
                         mixed_cuda_graphs=False, **options)  # decode graphs only: mixed steps run eagerly
    assert tokens == expected
    assert engine.runner.num_graph_steps > 0
    rows = seen[0]
    assert rows and all(hidden == ids == batch for hidden, ids, batch in rows)  # padding never reaches the hook
    sizes = engine.runner.graphs.batch_sizes
    assert any(batch not in sizes for *_, batch in rows)  # some steps were padded (9 prompts -> a batch of 16)
    assert engine.expert_stats["prefetch_misses"] > 0 and engine.experts.num_offloaded > 0
    assert engine.allocator.pages_of("step-graphs", "kv") == [engine.runner.graphs.scratch_page]


def test_replays_issue_the_hooks_prefetch_after_queueing_the_next_piece(family):
    """Under captured graphs a hook's returned prefetch runs right after the next replay, before the next hook, so
    the GPU computes while the host issues the copies; nothing is dropped at the end of a pass."""
    from rimuru.model_runner import StepInputs
    from rimuru.models.pieces import RoutingPoint
    from rimuru.step_graphs import _Captured

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
    graphs.captured[Shape.decode(size)] = _Captured([Graph(i) for i in range(num_pieces)], points)

    def hook(layer, hidden, topk_ids):
        events.append(("hook", layer))
        return lambda: events.append(("prefetch", layer))

    one = torch.zeros(1, dtype=torch.int64)
    inputs = StepInputs(one, one, one, torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                        one, [0])  # fmt: skip
    graphs.run(inputs, hook, Shape.decode(size))
    assert events == [("replay", 0), ("hook", 0), ("replay", 1), ("prefetch", 0), ("hook", 1), ("replay", 2),
                      ("prefetch", 1)]  # fmt: skip


def test_mixed_token_sizes_step_by_64_then_128_and_end_at_the_limit():
    assert mixed_token_sizes(8192)[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 640]
    assert mixed_token_sizes(8192)[-1] == 2048 and len(mixed_token_sizes(8192)) == 20
    assert mixed_token_sizes(300) == [64, 128, 192, 256, 300]
    assert mixed_token_sizes(0) == []
    assert graph_limits(256, 0) == (256, 256) and graph_limits(256, 8192) == (256, 2048)
    assert graph_limits(1024, 300) == (512, 512)


def test_mixed_graphs_reserve_their_larger_passes_from_the_budget(family):
    """Where the reserve is estimated, it grows with the most tokens a graph takes, and the plan takes it from the
    pool; a budget that cannot hold it is refused with the numbers."""
    from rimuru.config import parse_bytes
    from rimuru.memory_plan import activation_bytes, estimated_reserve, graph_point_bytes, plan_memory
    from rimuru.models import ModelConfig

    config, cuda, dtype = ModelConfig.from_hf(family[0]), torch.device("cuda"), torch.bfloat16  # budget: no query
    reserve = lambda tokens: estimated_reserve(config, cuda, dtype, 8192, 256, 256, tokens)
    plan = lambda tokens: plan_memory(cuda, 2**34, 2**30, 2**32, reserve(tokens)).pool_bytes
    grown = activation_bytes(config, dtype, 2048, 256, 1) - activation_bytes(config, dtype, 256, 256, 1)
    grown += graph_point_bytes(config, dtype, 2048) - graph_point_bytes(config, dtype, 256)
    assert plan(256) == plan(0) and plan(256) - plan(2048) == grown > 0
    weights = 2**30 + plan(2048) + 1  # the budget then holds the decode graphs' reserve, not the mixed graphs'
    with pytest.raises(ValueError, match=r"at least (\S+)GiB, or lower max_num_batched_tokens or max_num_seqs") as no:
        plan_memory(cuda, 2**34, weights, 2**32, reserve(2048), min_pool_bytes=2**20)
    smallest = parse_bytes(re.search(r"at least (\S+GiB)", str(no.value)).group(1))
    assert plan_memory(cuda, smallest, weights, 2**32, reserve(2048), min_pool_bytes=2**20).pool_bytes >= 2**20
    assert plan_memory(cuda, 2**34, weights, 2**32, reserve(256)).pool_bytes > 0


def record_shapes(engine) -> list[tuple[Shape, int, int]]:
    """(shape, real tokens, rows the hook saw) for every graph step; the rows -1 when no hook ran."""
    runner, seen = engine.runner, []
    run_graph = runner.graphs.run

    def run(inputs, on_routing, shape):
        rows = []

        def hook(layer, hidden, topk_ids):
            rows.append(hidden.shape[0])
            return on_routing(layer, hidden, topk_ids)

        out = run_graph(inputs, hook if on_routing is not None else None, shape)
        seen.append((shape, len(inputs.input_ids), rows[0] if rows else -1))
        assert out.shape[0] == len(inputs.sample_rows)
        return out

    runner.graphs.run = run
    return seen


@pytest.mark.parametrize("policy", ["elastic", "fixed"])
def test_mixed_steps_replay_the_padded_path_and_change_speed_never_tokens(family, policy):
    """With mixed_cuda_graphs, steps that mix prefill chunks and decodes run the padded graph path (here eagerly on
    the CPU): same tokens as Hugging Face, under offloading and preemption, and the hook sees the real tokens only."""
    folder, prompts, expected = family
    budget = budget_for(folder, kv_tokens=60, offload=3)
    options = dict(gpu_memory_budget=budget, expert_policy=policy, expert_offload_limit=3, offload_per_layer=3,
                   cuda_graphs=True, mixed_cuda_graphs=True, expert_reads="copy")  # fmt: skip
    seen = []
    engine, tokens = run(folder, prompts, prepare=lambda e: seen.append(record_shapes(e)), **options)
    assert tokens == expected
    mixed = [(shape, real, rows) for shape, real, rows in seen[0] if shape.mixed]
    assert mixed and any(shape.tokens > real for shape, real, _ in mixed)  # some were padded
    assert all(rows in (real, -1) for _, real, rows in mixed)  # padding never reaches the hook
    assert any(not shape.mixed for shape, _, _ in seen[0])
    assert engine.expert_stats["prefetch_misses"] > 0
    assert engine.runner.num_graph_steps == len(seen[0]) == engine.num_steps  # every step fit a shape


def stand_in_cuda_graphs(monkeypatch) -> None:
    """torch.cuda's graph API stood in for on the CPU, enough for `capture_all` and a replay."""

    class StandIn:  # torch.cuda.CUDAGraph, Stream and the stream context
        def __init__(self, *args, **kwargs):
            self.replays = 0

        def capture_begin(self, pool=None):
            assert pool == "pool"

        def capture_end(self):
            pass

        def replay(self):
            self.replays += 1

        def wait_stream(self, other):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    for name, value in [("CUDAGraph", StandIn), ("Stream", StandIn), ("stream", StandIn), ("current_stream", StandIn),
                        ("graph_pool_handle", lambda: "pool"), ("synchronize", lambda *a: None)]:  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)


def test_the_capture_branch_runs_every_shape_with_stand_in_graphs(family, monkeypatch):
    """`capture_all` and a replayed step, with torch.cuda's graph API stood in for on the CPU: every decode and
    mixed shape is captured into one pool, largest first, with one graph a piece, and a replay feeds the hook the
    captured routing points (real rows only) and returns the sampled rows. Catches what only the GPU path runs."""
    from rimuru.model_runner import StepInputs

    folder, prompts, _ = family
    engine, _ = run(folder, prompts[:1], cuda_graphs=True, mixed_cuda_graphs=True, max_num_seqs=16,
                    max_num_batched_tokens=200)  # fmt: skip
    graphs, captured_order = engine.runner.graphs, []

    stand_in_cuda_graphs(monkeypatch)
    original = type(graphs)._capture

    def recording(self, shape, pool):
        captured_order.append(shape)
        return original(self, shape, pool)

    monkeypatch.setattr(type(graphs), "_capture", recording)
    graphs.capture = True
    graphs.capture_all(progress=False)
    num_moe = len(engine.model_config.moe_layer_ids)
    assert set(graphs.captured) == set(graphs.shapes) and any(s.mixed for s in graphs.shapes)
    assert [s.tokens for s in captured_order] == sorted((s.tokens for s in captured_order), reverse=True)
    assert all(len(c.graphs) == num_moe + 1 and len(c.points) == num_moe for c in graphs.captured.values())
    seen = []
    ids, starts = torch.tensor([5, 6, 7], dtype=torch.int64), torch.tensor([0, 3], dtype=torch.int32)
    inputs = StepInputs(ids, torch.arange(3), torch.zeros(1, dtype=torch.int64), starts,
                        torch.tensor([3], dtype=torch.int32), torch.tensor([2]), [0])  # fmt: skip  # a 3-token prefill
    shape = graphs.shape_for(inputs)
    logits = graphs.run(inputs, lambda layer, hidden, topk_ids: seen.append(topk_ids.shape[0]), shape)
    assert shape.mixed and logits.shape == (1, engine.model_config.vocab_size)
    assert seen == [3] * num_moe and all(g.replays == 1 for g in graphs.captured[shape].graphs)


def test_a_resident_engine_captures_each_shape_whole(family, monkeypatch):
    """Every expert resident and nothing counting routing: no hook ever runs mid-pass, so each shape is one graph
    with no routing points (nor their buffers), and a hook offered at a replay is refused, not skipped."""
    from rimuru.model_runner import StepInputs

    folder, prompts, _ = family
    engine, _ = run(folder, prompts[:1], expert_policy="resident", cuda_graphs=True, max_num_seqs=16,
                    max_num_batched_tokens=200)  # fmt: skip
    graphs = engine.runner.graphs
    stand_in_cuda_graphs(monkeypatch)
    graphs.capture = True
    graphs.capture_all(progress=False)
    assert set(graphs.captured) == set(graphs.shapes)
    assert all(len(c.graphs) == 1 and not c.points for c in graphs.captured.values())
    assert graphs.point_ids is None and graphs.point_hidden is None
    inputs = StepInputs(torch.tensor([5]), torch.arange(1), torch.zeros(1, dtype=torch.int64),
                        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                        torch.tensor([0]), [0])  # fmt: skip  # one decode
    with pytest.raises(RuntimeError, match="captured whole"):
        graphs.run(inputs, lambda *routing: None, graphs.shape_for(inputs))


def test_cpu_runs_eagerly_unless_asked(family):
    folder, prompts, expected = family
    engine, tokens = run(folder, prompts[:2])
    assert engine.runner.graphs is None and engine.runner.num_graph_steps == 0
    assert not engine.allocator.owns("step-graphs")


# the GPU tests' engines capture 5 decode sizes and 4 mixed token counts, not 35 and 20 (the 10 tests took 7 minutes)
SMALL_GRAPH_SET = {"max_num_seqs": 16, "max_num_batched_tokens": 256}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy,reads", [("resident", "copy"), ("fixed", "copy"), ("fixed", "direct")])
def test_captured_graphs_give_the_eager_tokens_on_gpu(family, policy, reads):
    """8 prompts decode as one batch of 8, a captured size, so graph and eager run the same kernels and tiles;
    direct reads (the kernels reading pinned host memory) give the copies' tokens too."""
    folder, prompts, _ = family
    prompts = prompts[:8]
    assert NUM_PROMPTS >= 8
    options = dict(device="cuda", dtype=torch.float32, expert_policy=policy, offload_per_layer=3, **SMALL_GRAPH_SET)
    if policy == "fixed":
        options["gpu_memory_budget"] = budget_for(folder, kv_tokens=400, offload=3, **SMALL_GRAPH_SET) + 2**30
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy,reads", [("resident", "direct"), ("fixed", "copy"), ("elastic", "copy"),
                                          ("elastic", "direct")])  # fmt: skip
def test_captured_mixed_steps_give_the_eager_tokens_on_gpu(family, policy, reads, monkeypatch):
    """Every step, prefills included, replays captured graphs and gives the eager engine's tokens (fp32; the padded
    token counts may pick other MoE tiles than eager, which fp32 absorbs); elastic on a budget that evicts, with
    host experts copied in and read in place."""
    folder, prompts, _ = family
    pin_step_reserve(monkeypatch)  # the eager and the graph engine get the pool the budget was computed for
    options = dict(device="cuda", dtype=torch.float32, expert_policy=policy, offload_per_layer=3,
                   expert_offload_limit=3, expert_reads=reads, **SMALL_GRAPH_SET)  # fmt: skip
    if policy == "fixed":
        options["gpu_memory_budget"] = budget_for(folder, kv_tokens=400, offload=3, **SMALL_GRAPH_SET) + 2**30
    if policy == "elastic":  # the plan of the mixed-graph engine, KV for 60 tokens: evictions under the graphs
        options["gpu_memory_budget"] = budget_for(folder, kv_tokens=60, offload=3, device="cuda", dtype=torch.float32,
                                                  mixed_cuda_graphs=True, **SMALL_GRAPH_SET)  # fmt: skip
    outputs = {}
    for mixed in (False, True):
        llm = None
        free_gpu_memory()
        llm = LLM(folder, progress=False, cuda_graphs=mixed, mixed_cuda_graphs=mixed, **options)
        outputs[mixed] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        engine = llm.engine
        assert (engine.runner.num_graph_steps == engine.num_steps) == mixed
        if policy == "elastic" and mixed:
            assert engine.expert_stats["evictions"] > 0
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_count_the_routing_an_observer_sees_on_gpu(family, monkeypatch):
    """The routing each captured pass counts in its last graph (`RoutingCounter.count_pass`: the cost rule's
    popularity, the host experts read in place) is what an observer sees between the replays: padding rows count
    nothing, and an expert is read once a layer a pass."""
    folder, prompts, _ = family
    pin_step_reserve(monkeypatch)
    budget = budget_for(folder, kv_tokens=60, offload=3, device="cuda", dtype=torch.float32, mixed_cuda_graphs=True,
                        **SMALL_GRAPH_SET)  # fmt: skip
    tokens, reads, flushed = {}, [], []

    def prepare(engine):
        popularity, store, flush = engine.adjuster.popularity, engine.experts, engine.adjuster.popularity.flush

        def observe(layer, hidden, ids):
            tokens[layer] = tokens.get(layer, 0) + torch.bincount(ids.flatten(), minlength=popularity.num_experts)
            reads.append(len(set(ids.flatten().tolist()) & store.offloaded[layer]))

        def counting_flush(num_steps=1):
            flushed.append(popularity.pending.clone())
            flush(num_steps)

        popularity.flush = counting_flush
        engine.expert_manager.counter.observers.append(observe)

    engine, _ = run(folder, prompts, prepare, device="cuda", dtype=torch.float32, gpu_memory_budget=budget,
                    expert_offload_limit=3, adjuster="cost", expert_reads="direct", cuda_graphs=True,
                    mixed_cuda_graphs=True, **SMALL_GRAPH_SET)  # fmt: skip
    assert engine.runner.num_graph_steps == engine.num_steps and engine.expert_stats["evictions"] > 0
    assert engine.expert_manager.direct_reads() == sum(reads) > 0
    popularity = engine.adjuster.popularity
    counted = sum(flushed) + popularity.pending
    for layer, row in popularity.row.items():
        assert torch.equal(counted[row].cpu(), tokens[layer].cpu()), f"layer {layer}"


def test_a_failed_capture_falls_back_to_eager_unless_graphs_were_asked_for(family, monkeypatch, caplog):
    import rimuru.engine
    import rimuru.step_graphs

    folder, prompts, expected = family

    def broken(self, progress=False):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(rimuru.step_graphs.StepGraphs, "capture_all", broken)
    monkeypatch.setattr(rimuru.engine, "graphs_wanted", lambda cuda_graphs, device: True)  # a GPU's default
    engine, tokens = run(folder, prompts[:3])
    assert engine.runner.graphs is None and "every step runs eagerly" in caplog.text
    assert not engine.allocator.owns("step-graphs")
    assert tokens == expected[:3]
    with pytest.raises(RuntimeError, match="stream is capturing"):
        LLM(folder, progress=False, cuda_graphs=True)


@pytest.mark.parametrize("policy", ["resident", "fixed", "elastic"])
def test_mixed_graphs_are_on_by_default_under_every_policy(policy):
    """Their memory pool is profiled before the pool is sized, so every policy pays only what they take."""
    def resolve(**options):
        return EngineConfig(model="m", expert_policy=policy, **options).resolve(4096, torch.bfloat16)

    assert resolve().mixed_cuda_graphs
    assert not resolve(mixed_cuda_graphs=False).mixed_cuda_graphs
