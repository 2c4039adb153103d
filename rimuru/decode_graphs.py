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

With `mixed` (opt-in until measured on a GPU) steps that mix prefill chunks and decodes replay graphs too, one
shape per padded token count T (`mixed_token_sizes`): the batch's R requests come first, each padding token is a
1-token padding request after them, and the request slots left over hold no token (T + 1 slots in all, so the
attention kernels never take the batch for a decode one):

    tokens    | the batch's T_real tokens, request by request | T_real .. T-1: padding, one request each     |
    requests  | 0 .. R-1: the batch                           | R .. R+T-T_real-1: padding | the rest: empty |

Batches above the largest size run eagerly. Without `capture` (CPU, where there are no CUDA graphs) `run` executes
the pieces eagerly over the same static, padded buffers: the tests use that to check the padding and the hook on
the CPU.
"""

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm import tqdm

from rimuru.memory import KV
from rimuru.models import ForwardContext, QwenMoeForCausalLM
from rimuru.models.pieces import Pieces, RoutingPoint, run_pieces

MAX_GRAPH_BATCH = 512
MAX_MIXED_TOKENS = 2048  # larger prefill steps are compute-bound: they run eagerly
logger = logging.getLogger("rimuru")


class Shape(NamedTuple):
    """What one set of graphs is captured for: padded tokens T, request slots B, sampled rows S."""

    tokens: int
    requests: int
    sampled: int
    mixed: bool  # prefill chunks and decodes (else one token a request, T = B = S)

    @classmethod
    def decode(cls, size: int) -> "Shape":
        return cls(size, size, size, False)

    @classmethod
    def mixed_step(cls, tokens: int, top: int) -> "Shape":
        return cls(tokens, tokens + 1, min(tokens, top), True)


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


def capture_decode_graphs(model: QwenMoeForCausalLM, pool, allocator, experts, kv_tables: torch.Tensor | None,
                          max_num_seqs: int, cuda_graphs: bool | None, progress: bool,
                          mixed_tokens: int = 0):  # fmt: skip
    """The engine's decode graphs, captured, with their scratch KV page reserved from `allocator` for good; with
    `mixed_tokens` (the step's token limit) mixed steps' graphs too. None without `kv_tables` (the KV cache's device
    copy, kept only when graphs are wanted: they gather from it), or when a capture nobody asked for explicitly fails
    (a warning says so; steps run eagerly)."""
    device = pool.device
    if kv_tables is None:
        return None
    page_ids = allocator.allocate("decode-graphs", 1, KV)
    if page_ids is None:
        raise ValueError("the pool has no KV page left for the CUDA graphs' padding rows; raise gpu_memory_budget")
    sizes = graph_batch_sizes(max_num_seqs)
    mixed = mixed_token_sizes(mixed_tokens) if mixed_tokens else []
    graphs = DecodeGraphs(model, pool.kv_view(), experts.store.expert_view, experts.working_tables, kv_tables,
                          page_ids[0], sizes, capture=device.type == "cuda", host_experts=experts.host_experts,
                          mixed_sizes=mixed)  # fmt: skip
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
        logger.info("captured decode CUDA graphs for %d batch sizes up to %d and %d mixed token counts in %.1f s",
                    len(sizes), sizes[-1], len(mixed), time.perf_counter() - start)  # fmt: skip
    return graphs


@dataclass
class _Captured:
    graphs: list  # one torch.cuda.CUDAGraph per piece
    points: list[RoutingPoint]  # what the hook reads after graph i: views of the shared point buffers


class DecodeGraphs:
    def __init__(self, model: QwenMoeForCausalLM, kv_view: torch.Tensor, expert_view: torch.Tensor,
                 expert_tables: torch.Tensor, kv_tables: torch.Tensor, scratch_page: int, batch_sizes: list[int],
                 capture: bool, host_experts: dict | None = None, mixed_sizes: list[int] = ()):  # fmt: skip
        self.model, self.kv_view, self.expert_view, self.expert_tables = model, kv_view, expert_view, expert_tables
        self.kv_tables = kv_tables  # [L, slots, P] the KV cache's page tables on the device, kept up to date by it
        self.host_experts = host_experts  # pinned: fixed addresses the graphs may read (expert_reads="direct")
        self.batch_sizes, self.capture = sorted(batch_sizes), capture
        self.mixed_sizes = sorted(mixed_sizes)  # token counts of the mixed steps' graphs (none: decode only)
        self.scratch_page, self.page_tokens = scratch_page, kv_view.shape[2]
        kv_view[scratch_page].zero_()  # padding tokens read it: finite values from the start
        top = self.batch_sizes[-1]
        self.shapes = [Shape.mixed_step(t, top) for t in self.mixed_sizes] + [Shape.decode(s) for s in self.batch_sizes]
        dev, tokens = kv_view.device, max(s.tokens for s in self.shapes)
        requests = max(s.requests for s in self.shapes)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.padding_rows = torch.ones(tokens, dtype=torch.bool, device=dev)
        self.slots = torch.zeros(requests, dtype=torch.int64, device=dev)  # each request's row in `kv_tables`
        self.seq_lens = torch.ones(requests, dtype=torch.int32, device=dev)
        self.padding_requests = torch.ones(requests, dtype=torch.bool, device=dev)
        # decode shapes: token i is request i and is sampled
        self.rows = torch.arange(tokens, dtype=torch.int64, device=dev)
        self.decode_starts = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one token a request
        # mixed shapes: each token's request, where each request's tokens start, the sampled tokens
        self.token_requests = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.mixed_starts = torch.zeros(requests + 1, dtype=torch.int32, device=dev)
        self.sampled_tokens = torch.zeros(top, dtype=torch.int64, device=dev)
        # NOTE: every shape's graphs write their outputs into these shared buffers (the last piece also converts the
        # logits to fp32, which the sampler does anyway): outputs kept per size would hold 1.8 GB of a 30 GiB budget
        # for Qwen1.5-MoE (35 sizes x (logits + router inputs)). Each step reads them before the next replay.
        self.logits: torch.Tensor | None = None  # [top, V] fp32
        self.point_hidden: torch.Tensor | None = None  # [MoE layers, tokens, D]
        self.point_ids: torch.Tensor | None = None  # [MoE layers, tokens, K]
        self.captured: dict[Shape, _Captured] = {}

    def holds(self, inputs) -> bool:
        """Whether a captured shape takes this step (`StepInputs`)."""
        return self.shape_for(inputs) is not None

    def shape_for(self, inputs) -> Shape | None:
        num_tokens, num_requests = len(inputs.input_ids), len(inputs.seq_lens)
        if inputs.is_decode:
            if num_requests <= self.batch_sizes[-1]:
                return Shape.decode(next(s for s in self.batch_sizes if s >= num_requests))
            return None
        fits = [t for t in self.mixed_sizes if t >= num_tokens]
        if not fits or num_requests > self.batch_sizes[-1]:
            return None
        return Shape.mixed_step(fits[0], self.batch_sizes[-1])

    # ---- capture -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self, progress: bool = False) -> None:
        """Warm up and capture every shape, largest first, into one memory pool (a no-op without `capture`)."""
        if not self.capture:
            return
        self._allocate_outputs()
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.kv_view.device)
        shapes = sorted(self.shapes, key=lambda s: (s.tokens, s.mixed), reverse=True)
        shapes = tqdm(shapes, desc="Capturing CUDA graphs", unit="shape", disable=not progress)
        for shape in shapes:
            self._write_padding_only(shape)
            run_pieces(self._pieces(shape), None)  # compiles the kernels
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.captured[shape] = self._capture(shape, pool)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _allocate_outputs(self) -> None:
        config, top, tokens = self.model.config, self.batch_sizes[-1], len(self.input_ids)
        dtype, dev = self.model.lm_head.weight.dtype, self.kv_view.device
        num_moe = len(config.moe_layer_ids)
        self.logits = torch.empty(top, config.vocab_size, dtype=torch.float32, device=dev)
        self.point_hidden = torch.empty(num_moe, tokens, config.hidden_size, dtype=dtype, device=dev)
        self.point_ids = torch.empty(num_moe, tokens, config.num_experts_per_tok, dtype=torch.int64, device=dev)

    def _capture(self, shape: Shape, pool) -> _Captured:
        # NOTE: capture_begin/end rather than `torch.cuda.graph`, which collects garbage around each of the
        # (shapes x MoE layers) captures.
        pieces = self._pieces(shape)
        graphs, points = [], []
        while True:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                point = self._store_point(len(points), shape.tokens, next(pieces))
            except StopIteration as done:
                point = None
                self.logits[: shape.sampled].copy_(done.value)
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
        """Logits [B', V] of a step (`StepInputs`) that a captured shape holds, padded to it."""
        shape = self.shape_for(inputs)
        num_tokens, num_sampled = len(inputs.input_ids), len(inputs.sample_rows)
        if shape.mixed:
            self._write_mixed(inputs, shape)
        else:
            self._write_decode(inputs)
            self._write_padding(len(inputs.seq_lens), shape.tokens)

        def hook(layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor):
            return on_routing(layer_idx, hidden[:num_tokens], topk_ids[:num_tokens])  # padding rows load nothing

        hook = hook if on_routing is not None else None
        if not self.capture:
            return run_pieces(self._pieces(shape), hook)[:num_sampled]
        captured, later = self.captured[shape], None
        for graph, point in zip(captured.graphs, captured.points + [None]):
            graph.replay()
            if later is not None:  # the hook's prefetch, issued while the GPU runs the piece just queued
                later()
            later = hook(*point) if point is not None and hook is not None else None
        return self.logits[:num_sampled]

    def _write_decode(self, inputs) -> None:
        """The batch's rows: four small host -> device copies (the page tables are gathered in the graph)."""
        num_requests = len(inputs.seq_lens)
        self.input_ids[:num_requests].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_requests].copy_(inputs.positions, non_blocking=True)
        self.slots[:num_requests].copy_(inputs.slots, non_blocking=True)
        self.seq_lens[:num_requests].copy_(inputs.seq_lens, non_blocking=True)
        self.padding_rows[:num_requests] = False

    def _write_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows (see the module docstring): of a decode shape, tokens and requests."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        self.padding_rows[start:end] = True

    def _write_mixed(self, inputs, shape: Shape) -> None:
        """A mixed step's layout (module docstring): its tokens and requests, then padding tokens, one request each,
        then empty request slots; the sampled tokens, then token 0 for the unused sampled rows."""
        num_tokens, num_requests, num_sampled = len(inputs.input_ids), len(inputs.seq_lens), len(inputs.sample_rows)
        num_padding = shape.tokens - num_tokens
        counts = inputs.query_start_loc.diff()  # [R] tokens of each request
        starts = torch.cat([inputs.query_start_loc, num_tokens + torch.arange(1, shape.requests - num_requests + 1,
                                                                              dtype=torch.int32).clamp(max=num_padding)])
        token_requests = torch.cat([torch.arange(num_requests).repeat_interleave(counts.long()),
                                    num_requests + torch.arange(num_padding)])  # fmt: skip
        sampled = torch.zeros(shape.sampled, dtype=torch.int64)
        sampled[:num_sampled] = inputs.logits_indices
        self.input_ids[:num_tokens].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(inputs.positions, non_blocking=True)
        self.slots[:num_requests].copy_(inputs.slots, non_blocking=True)
        self.seq_lens[:num_requests].copy_(inputs.seq_lens, non_blocking=True)
        self.mixed_starts[: shape.requests + 1].copy_(starts, non_blocking=True)
        self.token_requests[: shape.tokens].copy_(token_requests, non_blocking=True)
        self.sampled_tokens[: shape.sampled].copy_(sampled, non_blocking=True)
        self.padding_rows[:num_tokens] = False
        self.padding_rows[num_tokens : shape.tokens] = True
        self.input_ids[num_tokens : shape.tokens] = 0
        self.positions[num_tokens : shape.tokens] = 0
        self.padding_requests[:num_requests] = False
        self.padding_requests[num_requests : shape.requests] = True
        self.seq_lens[num_requests : shape.requests] = 1

    def _write_padding_only(self, shape: Shape) -> None:
        """Every token and request slot of `shape` padding (capture and warm-up)."""
        self._write_padding(0, shape.tokens)
        self.padding_requests[: shape.requests] = True
        self.seq_lens[: shape.requests] = 1
        if shape.mixed:
            self.mixed_starts[: shape.requests + 1] = torch.arange(shape.requests + 1).clamp(max=shape.tokens)
            self.token_requests[: shape.tokens] = self.rows[: shape.tokens]
            self.sampled_tokens[: shape.sampled] = 0

    def _pieces(self, shape: Shape) -> Pieces:
        """The pass over `shape`'s rows. Its first piece gathers the requests' KV page tables and the tokens' slot
        mappings from the device tables (padding requests get the scratch page), so a step copies no tables."""
        num_tokens, num_requests = shape.tokens, shape.requests
        positions, padding = self.positions[:num_tokens], self.padding_rows[:num_tokens]
        if shape.mixed:
            token_requests, starts = self.token_requests[:num_tokens], self.mixed_starts[: num_requests + 1]
            sampled, padding_requests = self.sampled_tokens[: shape.sampled], self.padding_requests[:num_requests]
        else:  # token i is request i, and every token is sampled
            token_requests, starts = self.rows[:num_tokens], self.decode_starts[: num_requests + 1]
            sampled, padding_requests = self.rows[:num_tokens], padding
        tables = self.kv_tables.index_select(1, self.slots[:num_requests])  # [L, B, P]
        tables = torch.where(padding_requests[None, :, None], self.scratch_page, tables)
        pages = tables[:, token_requests, positions // self.page_tokens].long()  # [L, T]
        ctx = ForwardContext(
            positions=positions,
            query_start_loc=starts,
            seq_lens=self.seq_lens[:num_requests],
            kv_page_tables=tables,
            slot_mappings=pages * self.page_tokens + positions % self.page_tokens,
            expert_page_tables=self.expert_tables,
            kv_view=self.kv_view,
            expert_view=self.expert_view,
            logits_indices=sampled,
            host_experts=self.host_experts,
            padding_rows=padding,
        )
        return (yield from self.model.steps(self.input_ids[:num_tokens], ctx))
