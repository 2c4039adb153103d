"""`profile_step_memory`: what a step takes on the device outside the page pool, measured before the pool is sized.

A budget is a promise: weights, pool and every step's work stay under it. vLLM keeps it by running a profile pass
before it sizes its KV cache; so does Rimuru. The engine's own passes run over a scratch pool of a few pages, every
expert and KV page table pointing into it (the values are garbage, the memory the same):

    graphs   the CUDA graphs of the largest decode and mixed shapes, captured into their memory pool, with their
             shared outputs and the KV cache's device tables: held for the engine's lifetime
    step     sampling max_num_seqs rows with every filter and log-probabilities on, and, when some step can run
             without a graph, an eager pass of max_num_batched_tokens before it: freed after each step

Each is the rise of the peak reserved bytes from an emptied cache. The pool then gets the budget less the weights,
`graph_bytes`, `step_bytes` and a margin (`MARGIN_BYTES` plus `MARGIN_FRACTION` of the two) for what the profile
does not run: the expert manager's and the adjuster's small tensors, the allocator's rounding.
On the CPU there is nothing to measure: `rimuru.memory_plan` estimates the reserve there.
"""

import gc
import logging
from dataclasses import dataclass

import torch

from rimuru.graph_inputs import Shape
from rimuru.memory import MemoryPool, PageSizes
from rimuru.request import Request
from rimuru.sampler import Sampler
from rimuru.sampling_params import SamplingParams
from rimuru.step_graphs import StepGraphs

logger = logging.getLogger("rimuru")

MARGIN_BYTES = 64 * 2**20
MARGIN_FRACTION = 0.05
_SCRATCH_EXPERT_PAGES = 4  # gate, up and down of "every" expert, and one page cut into KV pages


@dataclass(frozen=True)
class StepMemory:
    graph_bytes: int  # held: the graphs' memory pool, their outputs, the device page tables
    step_bytes: int  # transient: the sampler at max_num_seqs rows, and an eager pass where one can run

    @property
    def margin_bytes(self) -> int:
        return MARGIN_BYTES + int(MARGIN_FRACTION * (self.graph_bytes + self.step_bytes))

    @property
    def reserve_bytes(self) -> int:
        return self.graph_bytes + self.step_bytes + self.margin_bytes


@dataclass(frozen=True)
class ProfileShapes:
    """What the engine will run: its largest graph shapes (none without graphs) and its largest eager step."""

    decode_batch: int  # the largest decode graph (0: no graphs)
    mixed_tokens: int  # the largest mixed-step graph (0: none)
    eager_tokens: int  # the most tokens a step that no graph takes can carry (0: every step replays a graph)
    max_num_seqs: int
    max_model_len: int


@torch.inference_mode()
def profile_step_memory(model, sizes: PageSizes, shapes: ProfileShapes, num_layers: int, num_experts: int,
                        device: torch.device) -> StepMemory:  # fmt: skip
    """Measure `StepMemory` on a CUDA device (see the module docstring); leaves the device as it found it."""
    scratch = MemoryPool(sizes, _SCRATCH_EXPERT_PAGES * sizes.huge_page_bytes, device)
    expert_tables = torch.tensor([0, 1, 2], dtype=torch.int32, device=device).repeat(num_layers, num_experts, 1)
    scratch_kv_page = (_SCRATCH_EXPERT_PAGES - 1) * scratch.sizes.expert_page_bytes // sizes.kv_page_stride
    max_pages = -(-shapes.max_model_len // sizes.page_tokens)
    gc.collect()  # once, before the first reading: an unreachable engine's pool freed after it reads as a negative rise
    base = _settle(device)
    kv_tables = torch.full((num_layers, shapes.max_num_seqs, max_pages), scratch_kv_page, dtype=torch.int32,
                           device=device)  # fmt: skip
    graphs = _graphs(model, scratch, expert_tables, kv_tables, scratch_kv_page, shapes)
    graphs.capture_all()
    graph_bytes = _settle(device) - base
    logits = graphs.logits if graphs.capture else None
    if shapes.eager_tokens:
        eager = _eager_pass(model, scratch, expert_tables, kv_tables, scratch_kv_page, shapes)
    torch.cuda.reset_peak_memory_stats(device)
    if shapes.eager_tokens:
        logits = eager.run_padding(_eager_shape(shapes, sizes.page_tokens)).float()
    # zeroed in place (no allocation): a captured graph's logits are uninitialised until a replay, and NaN rows
    # would fail the sampler's draw
    _sample_worst_case(logits[: shapes.max_num_seqs].zero_())
    torch.cuda.synchronize(device)
    step_bytes = torch.cuda.max_memory_reserved(device) - base - graph_bytes
    del graphs, logits, kv_tables, scratch
    if shapes.eager_tokens:
        del eager
    _settle(device)
    memory = StepMemory(graph_bytes, max(0, step_bytes))
    logger.info("profiled a step outside the pool: graphs %.0f MiB, step %.0f MiB, margin %.0f MiB",
                graph_bytes / 2**20, memory.step_bytes / 2**20, memory.margin_bytes / 2**20)  # fmt: skip
    return memory


def _graphs(model, scratch: MemoryPool, expert_tables, kv_tables, scratch_kv_page: int,
            shapes: ProfileShapes) -> StepGraphs:  # fmt: skip
    """The largest decode and mixed graphs over the scratch pool (uncaptured when the engine runs without graphs:
    `capture_all` then does nothing)."""
    top = max(shapes.decode_batch, 1)
    mixed = [shapes.mixed_tokens] if shapes.mixed_tokens else []
    return StepGraphs(model, scratch.kv_view(), scratch.expert_view(), expert_tables, kv_tables, scratch_kv_page,
                      [top], capture=shapes.decode_batch > 0, mixed_sizes=mixed,
                      keep_router_inputs=False)  # fmt: skip


def _eager_pass(model, scratch: MemoryPool, expert_tables, kv_tables, scratch_kv_page: int,
                shapes: ProfileShapes) -> StepGraphs:  # fmt: skip
    """Uncaptured passes of the eager step's shape over the scratch pool."""
    return StepGraphs(model, scratch.kv_view(), scratch.expert_view(), expert_tables, kv_tables, scratch_kv_page,
                      [shapes.max_num_seqs], capture=False, mixed_sizes=[shapes.eager_tokens],
                      keep_router_inputs=False)  # fmt: skip


def _eager_shape(shapes: ProfileShapes, page_tokens: int) -> Shape:
    return Shape.mixed_step(shapes.eager_tokens, shapes.max_num_seqs, page_tokens)


def _sample_worst_case(logits: torch.Tensor) -> None:
    """Every row unseeded (drawn in chunks) with every filter and the most log-probabilities a request may ask."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, logprobs=20, max_tokens=1)
    requests = [Request(f"profile-{i}", [0], params, 1) for i in range(len(logits))]
    Sampler(torch.Generator(logits.device).manual_seed(0))(logits.float(), requests)


def _settle(device: torch.device) -> int:
    """Reserved bytes once the queue is drained and the cache emptied."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)

