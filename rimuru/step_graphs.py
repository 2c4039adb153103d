"""`StepGraphs`: forward passes replayed as CUDA graphs, the expert hook running between replays.

Eager decode spends most of a step on the host launching kernels that keep the GPU busy for a third of it
(docs/benchmarks/engine.md). Here the pieces of a pass between two MoE routings (`rimuru.models.pieces`) are
captured once per shape (a capture hook at each routing ends one piece's graph and begins the next), all in one memory pool: decode shapes for the batch sizes of `batch_sizes`, and with
`mixed_sizes` (the default for elastic, `EngineConfig.mixed_cuda_graphs`) shapes for steps that mix prefill chunks
and decodes, one per padded token count. A step writes its rows into the static buffers (`rimuru.graph_inputs`,
which also draws the padding layouts), pads them to the next captured shape and replays the pieces in order; between
two pieces it runs the routing hook on the real rows exactly as the eager pass does (copies of routed experts,
prefetch of the next layer's), so offloading works under graphs and the kernels read `expert_tables` as the hook
left them. The prefetch the hook hands back is issued after the next piece is queued, so the host issues its copies
while the GPU computes.

Batches above the largest shape run eagerly. Without `capture` (CPU, where there are no CUDA graphs) `run` executes
the pieces eagerly over the same static, padded buffers: the tests use that to check the padding and the hook on
the CPU.
"""

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from rimuru.graph_inputs import GraphInputs, Shape
from rimuru.memory import KV
from rimuru.models import QwenMoeForCausalLM
from rimuru.models.pieces import RoutingHook, RoutingPoint

MAX_GRAPH_BATCH = 512
MAX_MIXED_TOKENS = 2048  # larger prefill steps are compute-bound: they run eagerly
logger = logging.getLogger("rimuru")
SCRATCH_OWNER = "step-graphs"  # the allocator owner of the padding rows' KV page


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured sizes: 1, 2, 4, then every multiple of 8 up to max_num_seqs (at most MAX_GRAPH_BATCH), as vLLM."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


def mixed_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts captured for mixed steps: every multiple of 64 up to 512, then of 128, up to the step's token
    limit (at most MAX_MIXED_TOKENS); none for a limit of 0."""
    top = min(max_num_batched_tokens, MAX_MIXED_TOKENS)
    if top <= 0:
        return []
    sizes = [s for s in list(range(64, 513, 64)) + list(range(640, top + 1, 128)) if s < top]
    return sizes + [top]


def graph_limits(max_num_seqs: int, mixed_tokens: int) -> tuple[int, int]:
    """(the largest decode batch, the most tokens) any captured shape takes: what the graphs' memory pool holds."""
    top = graph_batch_sizes(max_num_seqs)[-1]
    return top, max([top, *mixed_token_sizes(mixed_tokens)])


def graphs_wanted(cuda_graphs: bool | None, device: torch.device) -> bool:
    """`cuda_graphs`, or by default whether the engine runs on a GPU."""
    return cuda_graphs if cuda_graphs is not None else device.type == "cuda"


def reserve_scratch_page(allocator) -> int:
    """The graphs' padding rows' KV page, taken before any expert is placed (an elastic start whose experts do not
    fit would otherwise fill the pool to the last page); ValueError when the pool has none."""
    page_ids = allocator.allocate(SCRATCH_OWNER, 1, KV)
    if page_ids is None:
        raise ValueError("the pool has no KV page left for the CUDA graphs' padding rows; raise gpu_memory_budget")
    return page_ids[0]


def capture_step_graphs(model: QwenMoeForCausalLM, pool, allocator, experts, kv_tables: torch.Tensor | None,
                        scratch_page: int, max_num_seqs: int, cuda_graphs: bool | None, progress: bool,
                        mixed_tokens: int = 0, state_views: tuple[torch.Tensor, torch.Tensor] | None = None,
                        always_resident: bool = False):  # fmt: skip
    """The engine's step graphs, captured: decode steps', and with `mixed_tokens` (the step's token limit) mixed
    steps' too; their padding rows use `scratch_page` (`reserve_scratch_page`). None without `kv_tables` (the KV
    cache's device copy, kept only when graphs are wanted: they gather from it), or when a capture nobody asked for
    explicitly fails (a warning says so, the scratch page goes back to the pool and steps run eagerly).
    `always_resident` (the resident policy): no hook ever runs and nothing needs routing counted, so the shapes are
    captured whole."""
    device = pool.device
    if kv_tables is None:
        return None
    sizes = graph_batch_sizes(max_num_seqs)
    mixed = mixed_token_sizes(mixed_tokens)
    counter = experts.counter
    # the routing counted inside the graphs; all experts resident, there is nothing a count could be for
    count_pass = counter.count_pass if counter.counts_routing and not always_resident else None
    graphs = StepGraphs(model, pool.kv_view(), experts.store.expert_view, experts.loader.working_tables, kv_tables,
                        scratch_page, sizes, capture=device.type == "cuda", host_experts=experts.host_experts,
                        mixed_sizes=mixed, count_pass=count_pass, keep_router_inputs=not experts.direct,
                        state_views=state_views, cut_at_routing=not always_resident)  # fmt: skip
    start = time.perf_counter()
    try:
        graphs.capture_all(progress)
    except RuntimeError as error:  # a driver or kernel that cannot be captured: serve, only slower
        if cuda_graphs:  # asked for explicitly: say so loudly
            raise
        logger.warning("CUDA graph capture failed (%s); every step runs eagerly (--no-cuda-graphs skips the "
                       "attempt)", error)  # fmt: skip
        allocator.free(SCRATCH_OWNER)  # the padding rows' scratch page goes back to the pool
        return None
    if graphs.capture:
        logger.info("captured decode CUDA graphs for %d batch sizes up to %d and %d mixed token counts in %.1f s",
                    len(sizes), sizes[-1], len(mixed), time.perf_counter() - start)  # fmt: skip
    return graphs


@dataclass
class _Captured:
    graphs: list  # one torch.cuda.CUDAGraph per piece
    points: list[RoutingPoint]  # what the hook reads after graph i: views of the shared point buffers


class _Cuts:
    """The captures' routing hook, one object for every warm-up and capture: a compiled pass guards on its hook, so
    it compiles at the warm-ups, never inside a capture (which a compile there would invalidate)."""

    def __init__(self):
        self.cut: RoutingHook | None = None  # the capture in progress cuts its graph here; None in a warm-up

    def __call__(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if self.cut is not None:
            self.cut(layer_idx, hidden, topk_ids)


class StepGraphs:
    def __init__(self, model: QwenMoeForCausalLM, kv_view: torch.Tensor, expert_view: torch.Tensor,
                 expert_tables: torch.Tensor, kv_tables: torch.Tensor, scratch_page: int, batch_sizes: list[int],
                 capture: bool, host_experts: dict | None = None, mixed_sizes: list[int] = (),
                 count_pass: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
                 keep_router_inputs: bool = True, state_views: tuple[torch.Tensor, torch.Tensor] | None = None,
                 cut_at_routing: bool = True):  # fmt: skip
        self.model, self.kv_view, self.expert_view, self.expert_tables = model, kv_view, expert_view, expert_tables
        # False: no hook will ever run mid-pass (every expert stays resident, nothing counts routing), so each shape
        # is captured whole: one replay a step, and a compiled pass without a graph break a MoE layer
        self.cut_at_routing = cut_at_routing
        # the routing hook's router inputs, kept for each MoE layer ([MoE layers, tokens, D]): only a hook that
        # predicts (expert_reads="copy") or observes reads them; without one their buffer would only cost KV pages
        self.keep_router_inputs = keep_router_inputs
        # the pass's routing counted inside its last graph ([L, T, K] ids, [T] real rows, the tables the pass read:
        # `RoutingCounter.count_pass`)
        self.count_pass = count_pass
        self.host_experts = host_experts  # pinned: fixed addresses the graphs may read (expert_reads="direct")
        self.batch_sizes, self.capture = sorted(batch_sizes), capture
        self.mixed_sizes = sorted(mixed_sizes)  # token counts of the mixed steps' graphs (none: decode only)
        top, page_tokens = self.batch_sizes[-1], kv_view.shape[2]
        self.shapes = [Shape.mixed_step(t, top, page_tokens) for t in self.mixed_sizes]
        self.shapes += [Shape.decode(s) for s in self.batch_sizes]
        linear_layers = len(model.config.linear_layer_ids)
        self.inputs = GraphInputs(kv_view, kv_tables, scratch_page, self.shapes, top, state_views, linear_layers)
        self.scratch_page = scratch_page  # the padding rows' KV page, the graphs' own
        # NOTE: every shape's graphs write their outputs into these shared buffers (the last piece also converts the
        # logits to fp32, which the sampler does anyway): outputs kept per size would hold 1.8 GB of a 30 GiB budget
        # for Qwen1.5-MoE (35 sizes x (logits + router inputs)). Each step reads them before the next replay.
        self.logits: torch.Tensor | None = None  # [top, V] fp32
        self.point_hidden: torch.Tensor | None = None  # [MoE layers, tokens, D]
        self.point_ids: torch.Tensor | None = None  # [MoE layers, tokens, K]
        self.captured: dict[Shape, _Captured] = {}
        self._cuts = _Cuts()

    def shape_for(self, inputs) -> Shape | None:
        """The captured shape that takes this step (`StepInputs`); None: it runs eagerly."""
        num_tokens, num_requests, top = len(inputs.input_ids), len(inputs.seq_lens), self.batch_sizes[-1]
        if num_requests > top:
            return None
        if inputs.is_decode:
            return Shape.decode(next(s for s in self.batch_sizes if s >= num_requests))
        fits = [t for t in self.mixed_sizes if t >= num_tokens]
        return Shape.mixed_step(fits[0], top, self.inputs.page_tokens) if fits else None

    # ---- capture -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self, progress: bool = False) -> None:
        """Warm up every shape, then capture them, largest first, into one memory pool (a no-op without
        `capture`). The warm-ups' memory goes back to the device before the first capture, so start-up peaks at
        the larger of the two, never their sum."""
        if not self.capture:
            return
        shapes = sorted(self.shapes, key=lambda s: (s.tokens, s.mixed), reverse=True)
        for shape in shapes:  # compiles the kernels, and a compiled pass as the capture will call it
            self.run_padding(shape, self._capture_hook())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._allocate_outputs()
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.kv_view.device)
        with _no_garbage_collection():
            for shape in tqdm(shapes, desc="Capturing CUDA graphs", unit="shape", disable=not progress):
                self.inputs.write_padding_only(shape)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.captured[shape] = self._capture(shape, pool)
                torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run_padding(self, shape: Shape, on_routing: RoutingHook | None = None) -> torch.Tensor:
        """An eager pass of `shape` whose rows are all padding: logits [S, V] (warm-ups and memory profiles)."""
        self.inputs.write_padding_only(shape)
        return self._forward(shape, on_routing)

    def _allocate_outputs(self) -> None:
        config, top, tokens = self.model.config, self.batch_sizes[-1], self.inputs.max_tokens
        dtype, dev = self.model.lm_head.weight.dtype, self.kv_view.device
        num_moe = len(config.moe_layer_ids)
        self.logits = torch.empty(top, config.vocab_size, dtype=torch.float32, device=dev)
        if not self.cut_at_routing:  # no routing points: graphs captured whole
            return
        if self.keep_router_inputs:
            self.point_hidden = torch.empty(num_moe, tokens, config.hidden_size, dtype=dtype, device=dev)
        self.point_ids = torch.empty(num_moe, tokens, config.num_experts_per_tok, dtype=torch.int64, device=dev)

    def _capture(self, shape: Shape, pool) -> _Captured:
        # NOTE: capture_begin/end rather than `torch.cuda.graph`, which collects garbage around each of the
        # (shapes x MoE layers) captures.
        graphs, points, piece = [], [], None  # piece: the graph being captured, None between two

        def begin_piece() -> None:
            nonlocal piece
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            piece = graph

        def end_piece() -> None:
            nonlocal piece
            graph, piece = piece, None
            graph.capture_end()
            graphs.append(graph)

        def cut(layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:  # the pass's routing hook
            points.append(self._store_point(len(points), shape.tokens, RoutingPoint(layer_idx, hidden, topk_ids)))
            end_piece()
            begin_piece()

        begin_piece()
        self._cuts.cut = cut
        try:
            self.logits[: shape.sampled].copy_(self._forward(shape, self._capture_hook()))
            if self.count_pass is not None:
                self.count_pass(self.point_ids[:, : shape.tokens], self._real_rows(shape), self.expert_tables)
        finally:
            self._cuts.cut = None
            if piece is not None:  # a capture that failed part-way still leaves capture mode
                end_piece()
        return _Captured(graphs, points)

    def _capture_hook(self) -> "_Cuts | None":
        return self._cuts if self.cut_at_routing else None

    def _store_point(self, index: int, size: int, point: RoutingPoint) -> RoutingPoint:
        """Copy a routing point into the shared buffers (inside the capture); the hook reads the copies."""
        topk_ids = self.point_ids[index, :size]
        topk_ids.copy_(point.topk_ids)
        if not self.keep_router_inputs:
            return RoutingPoint(point.layer_idx, None, topk_ids)
        hidden = self.point_hidden[index, :size]
        hidden.copy_(point.hidden)
        return RoutingPoint(point.layer_idx, hidden, topk_ids)

    # ---- a step ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, inputs, on_routing, shape: Shape) -> torch.Tensor:
        """Logits [B', V] of a step (`StepInputs`), padded to `shape` (its `shape_for`)."""
        num_tokens, num_sampled = len(inputs.input_ids), len(inputs.sample_rows)
        self.inputs.write(inputs, shape)

        def hook(layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor):
            rows = None if hidden is None else hidden[:num_tokens]  # padding rows load nothing
            return on_routing(layer_idx, rows, topk_ids[:num_tokens])

        hook = hook if on_routing is not None else None
        if not self.capture:
            return self._run_uncaptured(shape, hook)[:num_sampled]
        if hook is not None and not self.cut_at_routing:
            raise RuntimeError("these CUDA graphs were captured whole, so no routing hook can run mid-pass")
        captured, later = self.captured[shape], None
        for graph, point in zip(captured.graphs, captured.points + [None]):
            graph.replay()
            if later is not None:  # the hook's prefetch, issued while the GPU runs the piece just queued
                later()
            later = hook(*point) if point is not None and hook is not None else None
        return self.logits[:num_sampled]

    def _run_uncaptured(self, shape: Shape, hook) -> torch.Tensor:
        """The pass run eagerly over the static buffers (CPU), its routing counted as the last graph counts it."""
        if self.count_pass is None:
            return self._forward(shape, hook)
        routed = []

        def keeping(layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor):
            routed.append(topk_ids)
            return hook(layer_idx, hidden, topk_ids) if hook is not None else None

        logits = self._forward(shape, keeping)
        self.count_pass(torch.stack(routed), self._real_rows(shape), self.expert_tables)
        return logits

    def _real_rows(self, shape: Shape) -> torch.Tensor:
        """[T] True on the step's own token rows, False on the padding (written by `GraphInputs.write`)."""
        return ~self.inputs.padding_rows[: shape.tokens]

    def _forward(self, shape: Shape, on_routing: RoutingHook | None) -> torch.Tensor:
        """The pass over `shape`'s rows of the static buffers, calling `on_routing` at each MoE layer's routing."""
        input_ids, ctx = self.inputs.context(shape, self.expert_tables, self.kv_view, self.expert_view,
                                             self.host_experts)  # fmt: skip
        return self.model(input_ids, replace(ctx, on_routing=on_routing))


@contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Collect once, then not while capturing: an unreachable engine's graphs or pinned buffers freed mid-capture
    call CUDA (graph destroy, cudaHostUnregister), which invalidates the capture and leaves the range registered."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
