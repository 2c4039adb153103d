"""Tensor parallelism in the engine: rank 0 is the engine (scheduler, adjuster, allocator, sampler), every other
rank a `Worker` process that holds its shard of the weights (`rimuru.models.parallel`) and a pool of the same size
and geometry, and does what rank 0 tells it each step (docs/architecture.md, Tensor parallelism).

Rank 0 owns every decision, so the page tables agree by construction: each step it broadcasts one `StepMessage`,
the expert copies since the last one (layer, expert, page ids: each rank copies its own slice of that expert into
the same pages) and the pass's inputs with every page table it reads. Each rank then runs the same forward pass,
whose all-reduces meet; only rank 0 samples. With CUDA graphs every rank captures the same shapes in the same
order and replays the one rank 0 replays, from mirrors of its KV and expert tables that each step's message
updates. Expert reads are direct (a host expert is read where it lies, by every rank from its own pinned slices),
so no routing hook acts mid-pass. A rank that dies fails rank 0's next collective at once, one that hangs after
`timeout_s()`: never a silent hang.
"""

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rimuru.kv_cache import write_entries
from rimuru.kv_swap import HostPages, PageSwap, swap_views
from rimuru.memory import MemoryPool, page_sizes_for_model
from rimuru.models import ForwardContext, from_pretrained, parallel
from rimuru.step_graphs import StepGraphs

logger = logging.getLogger("rimuru")

def timeout_s() -> float:
    """Seconds a collective waits for a rank before it fails ($RIMURU_TP_TIMEOUT_S, else 120)."""
    return float(os.environ.get("RIMURU_TP_TIMEOUT_S", "120"))


@dataclass
class StepMessage:
    """What every rank needs for one pass, as host tensors; `stop` ends a worker."""

    # in rank 0's order: (layer, expert, its three page ids) for an expert copy, a `PageSwap` for a preemption's
    copies: list = field(default_factory=list)
    input_ids: torch.Tensor | None = None  # [T]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the ForwardContext's tensors
    decode_only: bool = False  # a hybrid's `ForwardContext.decode_only`
    step: object = None  # a replayed step's `StepInputs` (its `tensors`: the KV table rows synced, expert tables)
    shape: object = None  # the captured `Shape` it replays
    graph_sizes: tuple[list[int], list[int]] | None = None  # capture the step graphs: (decode sizes, mixed sizes)
    check: bool = False  # compare the ranks' tables (`check_message`) instead of a pass
    stop: bool = False


CONTEXT_TENSORS = ("positions", "query_start_loc", "seq_lens", "kv_page_tables", "slot_mappings",
                   "expert_page_tables", "logits_indices", "ssm_state_ids", "conv_state_ids",
                   "state_continues")  # fmt: skip  (the last three a hybrid's only)


def message_for(copies, input_ids: torch.Tensor, ctx: ForwardContext) -> StepMessage:
    tensors = {name: getattr(ctx, name).cpu() for name in CONTEXT_TENSORS if getattr(ctx, name) is not None}
    return StepMessage(list(copies), input_ids.cpu(), tensors, ctx.decode_only)


def replay_message(copies, inputs, shape, table_entries, expert_tables: torch.Tensor) -> StepMessage:
    """A replayed step for the other ranks: its inputs and shape, the KV table entries synced since the last replay
    (`KVCacheManager.sync_device`'s; None: none), the expert tables its kernels read."""
    tensors = {"expert_tables": expert_tables.cpu()}
    if table_entries is not None:
        tensors["table_slots"], tensors["table_columns"], tensors["table_values"] = table_entries
    return StepMessage(list(copies), tensors=tensors, step=inputs, shape=shape)


def graph_setup_message(copies, kv_tables: torch.Tensor, expert_tables: torch.Tensor, scratch_page: int,
                        sizes: list[int], mixed_sizes: list[int]) -> StepMessage:  # fmt: skip
    """Every rank captures the same step graphs, in the same order (their warm-ups' all-reduces meet)."""
    tensors = {"kv_tables": kv_tables.cpu(), "expert_tables": expert_tables.cpu(),
               "scratch_page": torch.tensor(scratch_page)}  # fmt: skip
    return StepMessage(list(copies), tensors=tensors, graph_sizes=(sizes, mixed_sizes))


def check_message(copies, expert_tables: torch.Tensor, working_tables: torch.Tensor,
                  kv_tables: torch.Tensor | None) -> StepMessage:  # fmt: skip
    """Rank 0's tables for every rank to compare with its own (`Worker.table_mismatches`): the experts' pages
    now, and what its graphs read (the working tables, the device KV tables; None without graphs)."""
    tensors = {"expert_tables": expert_tables.cpu(), "working_tables": working_tables.cpu()}
    if kv_tables is not None:
        tensors["kv_tables"] = kv_tables.cpu()
    return StepMessage(list(copies), tensors=tensors, check=True)


def expert_page_mismatches(expert_tables: torch.Tensor, page_owner: dict[int, tuple[int, int]]) -> list[str]:
    """Where rank 0's tables ([L, E, 3] page ids, -1 on the host) place an expert in pages this rank's last copies
    into them were not of that expert."""
    problems = []
    for layer, expert in (expert_tables[..., 0] >= 0).nonzero().tolist():
        for page in expert_tables[layer, expert].tolist():
            if page_owner.get(page) != (layer, expert):
                problems.append(f"page {page} holds {page_owner.get(page)} here, expert {(layer, expert)} on rank 0")
    return problems


def gather_problems(problems: list[str]) -> list[list[str]]:
    """Every rank's list of problems, by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, problems)
    return out


def broadcast(message: StepMessage | None) -> StepMessage:
    """Rank 0's message on every rank (rank 0 passes it, the others None)."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def init_rank(rank: int, size: int, rendezvous: str, device: torch.device) -> None:
    """Join the group of `size` (gloo on the CPU, NCCL on GPUs, one GPU a rank) and set this rank's shard."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s()))  # fmt: skip
    parallel.init(rank, size)


def start_workers(config, size: int, rendezvous: str) -> list:
    """Ranks 1 .. size-1 as processes of their own (spawned: no state of this one is inherited)."""
    context = mp.get_context("spawn")
    workers = [context.Process(target=worker_main, args=(rank, size, config, rendezvous), daemon=True)
               for rank in range(1, size)]  # fmt: skip
    for worker in workers:
        worker.start()
    return workers


def worker_main(rank: int, size: int, config, rendezvous: str) -> None:
    device = torch.device(config.device)
    init_rank(rank, size, rendezvous, device)
    try:
        Worker(config, device).serve()
    finally:
        dist.destroy_process_group()


class Worker:
    """A rank other than 0: its shard, its pool (the size rank 0 broadcasts), its host slices of the experts."""

    def __init__(self, config, device: torch.device):
        loaded = from_pretrained(config.model, device, config.dtype, config.load_format, config.router_skew, False,
                                 config.seed, config.router_regimes)  # fmt: skip
        self.model, self.experts = loaded.model, loaded.experts
        if config.compile:  # rank 0's compiled pass: the same all-reduces, traced as functional collectives
            from rimuru.compilation import compile_forward

            compile_forward(self.model, loaded.config.num_hidden_layers)
        first = broadcast(None)  # the pool's size, or a stop: rank 0 could not start
        self.stopped = first.stop
        if self.stopped:
            return
        pool_bytes = first.tensors["pool_bytes"].item()
        sizes = page_sizes_for_model(loaded.config, config.dtype, config.page_tokens)
        self.pool = MemoryPool(sizes, pool_bytes, device)
        self.kv_view, self.expert_view = self.pool.kv_view(), self.pool.expert_view()
        linear = bool(loaded.config.linear_layer_ids)  # a hybrid's state pages: (SSM view, conv view)
        self.state_views = dict(zip(("ssm_view", "conv_view"), self.pool.state_views())) if linear else {}
        self.host_experts = {layer: (w.gate, w.up, w.down) for layer, w in self.experts.items()}
        self.host_pages = HostPages(swap_views(self.pool, linear))  # this rank's halves of preempted requests' pages
        self.device = device
        self.graphs: StepGraphs | None = None
        self.page_owner: dict[int, tuple[int, int]] = {}  # expert page -> the (layer, expert) last copied into it

    def serve(self) -> None:
        while not self.stopped and not (message := broadcast(None)).stop:
            self.copy(message.copies)
            if message.check:
                gather_problems(self.table_mismatches(message.tensors))
            elif message.graph_sizes is not None:
                self.capture(message)
            elif message.shape is not None:
                self.replay(message)
            elif message.input_ids is not None:
                self.forward(message)

    def capture(self, message: StepMessage) -> None:
        """Rank 0's step graphs over this rank's pool, reading mirrors of its KV and expert tables."""
        tensors = message.tensors
        self.kv_tables = tensors["kv_tables"].to(self.device)
        self.expert_tables = tensors["expert_tables"].to(self.device)
        states = tuple(self.state_views.values()) or None  # (SSM view, conv view) of a hybrid
        sizes, mixed = message.graph_sizes
        self.graphs = StepGraphs(self.model, self.kv_view, self.expert_view, self.expert_tables, self.kv_tables,
                                 int(tensors["scratch_page"]), sizes, capture=self.device.type == "cuda",
                                 host_experts=self.host_experts, mixed_sizes=mixed, keep_router_inputs=False,
                                 state_views=states)  # fmt: skip
        self.graphs.capture_all()

    def table_mismatches(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """How this rank's pages and its graphs' table mirrors differ from rank 0's tables (empty: they agree)."""
        problems = expert_page_mismatches(tensors["expert_tables"], self.page_owner)
        if self.graphs is not None:
            if not torch.equal(self.expert_tables.cpu(), tensors["working_tables"]):
                problems.append("the graphs' expert tables differ from rank 0's")
            if not torch.equal(self.kv_tables.cpu(), tensors["kv_tables"]):
                problems.append("the graphs' KV tables differ from rank 0's")
        return problems

    @torch.inference_mode()
    def replay(self, message: StepMessage) -> None:
        tensors = message.tensors
        if "table_slots" in tensors:
            write_entries(self.kv_tables, tensors["table_slots"], tensors["table_columns"], tensors["table_values"])
        self.expert_tables.copy_(tensors["expert_tables"], non_blocking=True)
        self.graphs.run(message.step, None, message.shape)

    def copy(self, copies) -> None:
        for entry in copies:
            if isinstance(entry, PageSwap):
                self.host_pages.apply(entry)
                continue
            layer, expert, page_ids = entry
            self.page_owner |= dict.fromkeys(page_ids, (layer, expert))
            for page, matrix in zip(page_ids, self.experts[layer].matrices(expert)):
                self.expert_view[page].copy_(matrix.reshape(-1), non_blocking=True)

    @torch.inference_mode()
    def forward(self, message: StepMessage) -> None:
        tensors = {name: t.to(self.device) for name, t in message.tensors.items()}
        ctx = ForwardContext(**tensors, kv_view=self.kv_view, expert_view=self.expert_view,
                             host_experts=self.host_experts, decode_only=message.decode_only,
                             **(self.state_views if "ssm_state_ids" in tensors else {}))  # fmt: skip
        self.model(message.input_ids.to(self.device), ctx)  # its all-reduces meet rank 0's; the logits go unused


def rendezvous_path() -> str:
    """A fresh file for the ranks to meet at (torch.distributed's file:// rendezvous)."""
    import tempfile

    handle, path = tempfile.mkstemp(prefix="rimuru-tp-")
    os.close(handle)
    os.unlink(path)
    return path
