"""`DecodeGraphs`: decode-only forward passes replayed as CUDA graphs, the expert hook running between replays.

Eager decode of 200 requests spends 40 ms a step on the host launching kernels that keep an H200 busy for 14 ms
(docs/benchmarks/engine.md). Here the pieces of a pass between two MoE routings (`rimuru.models.pieces`) are
captured once per batch size of `batch_sizes`, all in one memory pool. A step writes its inputs into static
buffers, pads the batch to the next captured size and replays the pieces in order; between two pieces it runs the
routing hook on the real rows exactly as the eager pass does (copies of routed experts, prefetch of the next
layer's), so offloading works under graphs and the kernels read `expert_tables` as the hook left them. The
prefetch the hook hands back is issued after the next piece is queued, so the host issues its copies while the
GPU computes.

Padding rows are decodes of token 0 at position 0 with a single K/V slot in a scratch page that belongs to the
graphs, so they write into and read from no request's pages, and they route like row 0 (`padding_rows`), so they
touch no expert a real token does not:

    rows      | 0 .. B-1: the batch                 | B .. size-1: padding         |
    seq_len   | the request's                       | 1                            |
    pages     | its row of the device page tables   | scratch everywhere           |
    slot      | the new token's K/V slot            | scratch * page_tokens        |

Prefill chunks, mixed batches and batches above the largest size run eagerly. Without `capture` (CPU, where
there are no CUDA graphs) `run` executes the pieces eagerly over the same static, padded buffers: the tests use
that to check the padding and the hook on the CPU.
"""

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from rimuru.memory import KV
from rimuru.models import ForwardContext, QwenMoeForCausalLM
from rimuru.models.pieces import Pieces, RoutingPoint, run_pieces

MAX_GRAPH_BATCH = 512
logger = logging.getLogger("rimuru")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured sizes: 1, 2, 4, then every multiple of 8 up to max_num_seqs (at most MAX_GRAPH_BATCH), as vLLM."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


def graphs_wanted(cuda_graphs: bool | None, device: torch.device) -> bool:
    """`cuda_graphs`, or by default whether the engine runs on a GPU."""
    return cuda_graphs if cuda_graphs is not None else device.type == "cuda"


def capture_decode_graphs(model: QwenMoeForCausalLM, pool, allocator, experts, kv_tables: torch.Tensor | None,
                          max_num_seqs: int, cuda_graphs: bool | None, progress: bool):  # fmt: skip
    """The engine's decode graphs, captured, with their scratch KV page reserved from `allocator` for good. None
    without `kv_tables` (the KV cache's device copy, kept only when graphs are wanted: they gather from it), or when
    a capture nobody asked for explicitly fails (a warning says so; steps run eagerly)."""
    device = pool.device
    if kv_tables is None:
        return None
    page_ids = allocator.allocate("decode-graphs", 1, KV)
    if page_ids is None:
        raise ValueError("the pool has no KV page left for the CUDA graphs' padding rows; raise gpu_memory_budget")
    sizes = graph_batch_sizes(max_num_seqs)
    graphs = DecodeGraphs(model, pool.kv_view(), experts.store.expert_view, experts.working_tables, kv_tables,
                          page_ids[0], sizes, capture=device.type == "cuda", host_experts=experts.host_experts)
    start = time.perf_counter()
    try:
        graphs.capture_all(progress)
    except RuntimeError as error:  # a driver or kernel that cannot be captured: serve, only slower
        if cuda_graphs:  # asked for explicitly: say so loudly
            raise
        logger.warning("CUDA graph capture failed (%s); every step runs eagerly (--no-cuda-graphs skips the "
                       "attempt)", error)  # fmt: skip
        allocator.free("decode-graphs")  # the padding rows' scratch page goes back to the pool
        return None
    if graphs.capture:
        logger.info("captured decode CUDA graphs for %d batch sizes up to %d in %.1f s",
                    len(sizes), sizes[-1], time.perf_counter() - start)  # fmt: skip
    return graphs


@dataclass
class _Captured:
    graphs: list  # one torch.cuda.CUDAGraph per piece
    points: list[RoutingPoint]  # what the hook reads after graph i: views of the shared point buffers


class DecodeGraphs:
    def __init__(self, model: QwenMoeForCausalLM, kv_view: torch.Tensor, expert_view: torch.Tensor,
                 expert_tables: torch.Tensor, kv_tables: torch.Tensor, scratch_page: int, batch_sizes: list[int],
                 capture: bool, host_experts: dict | None = None):  # fmt: skip
        self.model, self.kv_view, self.expert_view, self.expert_tables = model, kv_view, expert_view, expert_tables
        self.kv_tables = kv_tables  # [L, slots, P] the KV cache's page tables on the device, kept up to date by it
        self.host_experts = host_experts  # pinned: fixed addresses the graphs may read (expert_reads="direct")
        self.batch_sizes, self.capture = sorted(batch_sizes), capture
        self.scratch_page, self.page_tokens = scratch_page, kv_view.shape[2]
        dev, top = kv_view.device, self.batch_sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(top, dtype=torch.int64, device=dev)  # each row's request in `kv_tables`
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.padding_rows = torch.ones(top, dtype=torch.bool, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one token a request
        self.logits_indices = torch.arange(top, dtype=torch.int64, device=dev)  # also: row ids
        # NOTE: every size's graphs write their outputs into these shared buffers (the last piece also converts the
        # logits to fp32, which the sampler does anyway): outputs kept per size would hold 1.8 GB of a 30 GiB budget
        # for Qwen1.5-MoE (35 sizes x (logits + router inputs)). Each step reads them before the next replay.
        self.logits: torch.Tensor | None = None  # [size, V] fp32
        self.point_hidden: torch.Tensor | None = None  # [MoE layers, size, D]
        self.point_ids: torch.Tensor | None = None  # [MoE layers, size, K]
        self.captured: dict[int, _Captured] = {}

    def holds(self, num_requests: int) -> bool:
        return num_requests <= self.batch_sizes[-1]

    def size_for(self, num_requests: int) -> int:
        return next(s for s in self.batch_sizes if s >= num_requests)

    # ---- capture -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self, progress: bool = False) -> None:
        """Warm up and capture every size, largest first, into one memory pool (a no-op without `capture`)."""
        if not self.capture:
            return
        self._allocate_outputs()
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.kv_view.device)
        sizes = tqdm(reversed(self.batch_sizes), total=len(self.batch_sizes), desc="Capturing decode CUDA graphs",
                     unit="size", disable=not progress)  # fmt: skip
        for size in sizes:
            self._write_padding(0, size)
            run_pieces(self._pieces(size), None)  # compiles the kernels
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.captured[size] = self._capture(size, pool)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _allocate_outputs(self) -> None:
        config, top = self.model.config, self.batch_sizes[-1]
        dtype, dev = self.model.lm_head.weight.dtype, self.kv_view.device
        num_moe = len(config.moe_layer_ids)
        self.logits = torch.empty(top, config.vocab_size, dtype=torch.float32, device=dev)
        self.point_hidden = torch.empty(num_moe, top, config.hidden_size, dtype=dtype, device=dev)
        self.point_ids = torch.empty(num_moe, top, config.num_experts_per_tok, dtype=torch.int64, device=dev)

    def _capture(self, size: int, pool) -> _Captured:
        # NOTE: capture_begin/end rather than `torch.cuda.graph`, which collects garbage around each of the
        # (sizes x MoE layers) captures.
        pieces = self._pieces(size)
        graphs, points = [], []
        while True:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                point = self._store_point(len(points), size, next(pieces))
            except StopIteration as done:
                point = None
                self.logits[:size].copy_(done.value)
            finally:
                graph.capture_end()
            graphs.append(graph)
            if point is None:
                return _Captured(graphs, points)
            points.append(point)

    def _store_point(self, index: int, size: int, point: RoutingPoint) -> RoutingPoint:
        """Copy a routing point into the shared buffers (inside the capture); the hook reads the copies."""
        hidden, topk_ids = self.point_hidden[index, :size], self.point_ids[index, :size]
        hidden.copy_(point.hidden)
        topk_ids.copy_(point.topk_ids)
        return RoutingPoint(point.layer_idx, hidden, topk_ids)

    # ---- a step ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, inputs, on_routing) -> torch.Tensor:
        """Logits [B, V] of a decode batch (`StepInputs` with one token a request), padded to the next size."""
        num_requests = len(inputs.seq_lens)
        size = self.size_for(num_requests)
        self._write_inputs(inputs)
        self._write_padding(num_requests, size)

        def hook(layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor):
            return on_routing(layer_idx, hidden[:num_requests], topk_ids[:num_requests])  # padding rows load nothing

        hook = hook if on_routing is not None else None
        if not self.capture:
            return run_pieces(self._pieces(size), hook)[:num_requests]
        captured, later = self.captured[size], None
        for graph, point in zip(captured.graphs, captured.points + [None]):
            graph.replay()
            if later is not None:  # the hook's prefetch, issued while the GPU runs the piece just queued
                later()
            later = hook(*point) if point is not None and hook is not None else None
        return self.logits[:num_requests]

    def _write_inputs(self, inputs) -> None:
        """The batch's rows: four small host -> device copies (the page tables are gathered in the graph)."""
        num_requests = len(inputs.seq_lens)
        self.input_ids[:num_requests].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_requests].copy_(inputs.positions, non_blocking=True)
        self.slots[:num_requests].copy_(inputs.slots, non_blocking=True)
        self.seq_lens[:num_requests].copy_(inputs.seq_lens, non_blocking=True)
        self.padding_rows[:num_requests] = False

    def _write_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows (see the module docstring)."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        self.padding_rows[start:end] = True

    def _pieces(self, size: int) -> Pieces:
        """The pass over the first `size` rows. Its first piece gathers the rows' KV page tables and slot mappings
        from the device tables (padding rows get the scratch page), so a step copies no tables."""
        rows, positions, padding = self.logits_indices[:size], self.positions[:size], self.padding_rows[:size]
        tables = self.kv_tables.index_select(1, self.slots[:size])  # [L, size, P]
        tables = torch.where(padding[None, :, None], self.scratch_page, tables)
        pages = tables[:, rows, positions // self.page_tokens].long()  # [L, size]
        ctx = ForwardContext(
            positions=positions,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            kv_page_tables=tables,
            slot_mappings=pages * self.page_tokens + positions % self.page_tokens,
            expert_page_tables=self.expert_tables,
            kv_view=self.kv_view,
            expert_view=self.expert_view,
            logits_indices=rows,
            host_experts=self.host_experts,
            padding_rows=padding,
        )
        return (yield from self.model.steps(self.input_ids[:size], ctx))
