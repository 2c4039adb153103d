"""`ModelRunner`: turns a `ScheduledBatch` into the model's `ForwardContext`, runs the forward pass, returns logits.

Builds the step's rows on the host; an eager pass then gathers the KV page tables and slot mappings from the KV
cache's host tables (a few vectorised gathers, no per-layer Python loops) and moves everything to the device, while
a step that the `StepGraphs` hold (decode-only, or mixed with `mixed_cuda_graphs`) copies only its rows into their
static buffers: the graphs gather the page tables from the KV cache's device copy themselves.
"""

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from rimuru.expert_manager import ExpertManager
from rimuru.kv_cache import KVCacheManager
from rimuru.linear_state_cache import LinearStateCache
from rimuru.models import ForwardContext, QwenMoeForCausalLM
from rimuru.pending_tokens import PendingTokens
from rimuru.scheduler import ScheduledBatch
from rimuru.step_graphs import StepGraphs


@dataclass
class StepInputs:
    """One step's model inputs on the host. T tokens, B requests, B' sampled rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [B] int64, each request's row of the KV cache's page tables
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    logits_indices: torch.Tensor  # [B'] int64
    sample_rows: list[int]  # batch rows of the B' logits
    request_ids: list[str] = field(default_factory=list)  # [B], whose state pages a hybrid model's linear layers read
    # a hybrid model's state pages of the batch ([L_linear, B] SSM and conv page ids; None: no linear layers)
    state_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    # token rows whose id is still on the device (sampled by the step before: async scheduling), and their requests
    pending_rows: list[int] = field(default_factory=list)
    pending_request_ids: list[str] = field(default_factory=list)
    pending_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) on the device, from `ModelRunner`

    def fill_pending(self, input_ids: torch.Tensor) -> None:
        """The pending tokens' ids into the step's input ids on the device (`input_ids` [T])."""
        if self.pending_ids is not None:
            rows, ids = self.pending_ids
            input_ids[rows] = ids

    @property
    def continues(self) -> torch.Tensor:
        """[B] bool: the request's first token this step is not its first, so its state holds earlier ones."""
        return self.positions[self.query_start_loc[:-1].long()] > 0

    @property
    def is_decode(self) -> bool:
        """Every request brings one token and is sampled (the shape CUDA graphs are captured for)."""
        return len(self.input_ids) == len(self.seq_lens) == len(self.sample_rows)


class ModelRunner:
    def __init__(self, model: QwenMoeForCausalLM, kv_cache: KVCacheManager, kv_view: torch.Tensor,
                 experts: ExpertManager, graphs: StepGraphs | None = None, states: LinearStateCache | None = None,
                 state_views: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        self.model, self.kv_cache, self.kv_view, self.experts = model, kv_cache, kv_view, experts
        self.graphs = graphs
        self.states, self.state_views = states, state_views  # a hybrid model's state pages: (SSM view, conv view)
        self.before_pass = None  # called with an eager pass's (input ids, context): tensor parallel ranks get them
        self.before_replay = None  # a replay's (inputs, shape, KV table rows synced, expert tables): the same
        self.device = kv_view.device
        self.num_graph_steps = 0  # steps run as graph replays

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> tuple[torch.Tensor, list[int]]:
        """Logits [B', V] (fp32) for the requests that finish their known tokens this round, and their batch rows.
        `pending`: the step before's tokens not yet on the host, which this step's input ids take on the device."""
        inputs = self.prepare(batch)
        if inputs.pending_rows:
            rows = torch.tensor(inputs.pending_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            inputs.pending_ids = rows, pending.device_ids(inputs.pending_request_ids, self.device)
        shape = self.graphs.shape_for(inputs) if self.graphs is not None else None
        if shape is not None:
            table_entries = self.kv_cache.sync_device()  # the graphs gather the batch's page tables on the device
            # the graphs read working_tables and count the pass's routing themselves
            counted = self.graphs.count_pass is not None
            expert_tables, hook = self.experts.pass_routing(fixed_tables=True, counted=counted)
            if self.before_replay is not None:
                self.before_replay(inputs, shape, table_entries, expert_tables)
            self.num_graph_steps += 1
            return self.graphs.run(inputs, hook, shape).float(), inputs.sample_rows
        input_ids, ctx = inputs.input_ids.to(self.device, non_blocking=True), self.context(inputs)
        inputs.fill_pending(input_ids)
        if self.before_pass is not None:
            self.before_pass(input_ids, ctx)
        logits = self.model(input_ids, ctx)  # [B', V]
        return logits.float(), inputs.sample_rows

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's rows (no page tables: graphs gather them on the device, `context` on the host)."""
        inputs = step_inputs(batch, self.kv_cache.slot)
        if self.states is not None:
            inputs.state_tables = self.states.state_tables(inputs.request_ids)
        return inputs

    def page_tables(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV page tables [L, B, P'] of the batch's requests, P' = pages of the longest; slot mappings [L, T]),
        gathered on the host from the KV cache's tables."""
        page_tokens, tables = self.kv_cache.page_tokens, self.kv_cache.tables  # tables [L, slots, P]
        token_slots = inputs.slots  # [T]: one token a request (decode)
        if len(inputs.input_ids) != len(inputs.slots):
            token_slots = inputs.slots.repeat_interleave(inputs.query_start_loc.diff())
        pages = tables[:, token_slots, inputs.positions // page_tokens].long()  # [L, T]
        max_pages = -(-int(inputs.seq_lens.max()) // page_tokens)
        return tables[:, inputs.slots, :max_pages], pages * page_tokens + inputs.positions % page_tokens

    def context(self, inputs: StepInputs) -> ForwardContext:
        """The eager pass's context: every input moved to the device."""
        dev = self.device
        tables, hook = self.experts.pass_routing()
        kv_page_tables, slot_mappings = self.page_tables(inputs)
        return ForwardContext(
            positions=inputs.positions.to(dev, non_blocking=True),
            query_start_loc=inputs.query_start_loc.to(dev, non_blocking=True),
            seq_lens=inputs.seq_lens.to(dev, non_blocking=True),
            kv_page_tables=kv_page_tables.to(dev, non_blocking=True),
            slot_mappings=slot_mappings.to(dev, non_blocking=True),
            expert_page_tables=tables,
            kv_view=self.kv_view,
            expert_view=self.experts.store.expert_view,
            logits_indices=inputs.logits_indices.to(dev, non_blocking=True),
            on_routing=hook,
            host_experts=self.experts.host_experts,
            **self._state_fields(inputs),
        )

    def _state_fields(self, inputs: StepInputs) -> dict:
        """A hybrid model's state pages of the batch, and whether each request's state holds earlier tokens."""
        if self.states is None:
            return {}
        dev, continues = self.device, inputs.continues
        ssm_ids, conv_ids = (ids.to(dev, non_blocking=True) for ids in inputs.state_tables)  # [L_linear, B] each
        return dict(ssm_view=self.state_views[0], conv_view=self.state_views[1], ssm_state_ids=ssm_ids,
                    conv_state_ids=conv_ids, state_continues=continues.to(dev, non_blocking=True),
                    decode_only=inputs.is_decode and bool(continues.all()))  # fmt: skip


def step_inputs(batch: ScheduledBatch, slot_of) -> StepInputs:
    """A batch's rows as host tensors; `slot_of(request_id)`: its row of the KV page tables. One comprehension a
    field, each made a tensor through numpy (`_int_tensor`): 0.73x the host time of one loop appending to all of
    them and `torch.tensor`, at 140 decodes on the development CPU (docs/benchmarks/allocator.md)."""
    requests, counts = batch.requests, batch.num_new_tokens
    starts = [request.num_computed_tokens for request in requests]
    ends = [start + count for start, count in zip(starts, counts)]
    query_starts = list(itertools.accumulate(counts, initial=0))
    # every known token computed: sample the next one
    sample_rows = [row for row, (request, end) in enumerate(zip(requests, ends)) if end == request.num_tokens]
    # a pending token (async scheduling) is a request's last; its id comes from the device
    pending = [(row, request) for row, (request, end) in enumerate(zip(requests, ends)) if end > request.num_known_tokens]
    return StepInputs(
        input_ids=_int_tensor([t for r, a, b in zip(requests, starts, ends) for t in r.token_ids(a, b)], np.int64),
        positions=_int_tensor([p for a, b in zip(starts, ends) for p in range(a, b)], np.int64),
        slots=_int_tensor([slot_of(request.request_id) for request in requests], np.int64),
        request_ids=[request.request_id for request in requests],
        query_start_loc=_int_tensor(query_starts, np.int32),
        seq_lens=_int_tensor(ends, np.int32),
        logits_indices=_int_tensor([query_starts[row + 1] - 1 for row in sample_rows], np.int64),
        sample_rows=sample_rows,
        pending_rows=[query_starts[row + 1] - 1 for row, _ in pending],
        pending_request_ids=[request.request_id for _, request in pending],
    )


def _int_tensor(values: list[int], dtype) -> torch.Tensor:
    """A host tensor from a list of ints, through numpy (faster than `torch.tensor` on a list)."""
    return torch.from_numpy(np.array(values, dtype=dtype))
