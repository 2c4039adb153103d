"""`Engine`: loads a model onto the page pool and runs scheduling rounds (docs/architecture.md, One round).

`step()` is the whole loop: schedule, run, sample, postprocess. Everything else here is start-up wiring and the
per-request bookkeeping around it (tokenising, stop conditions). Front ends (`LLM`, the HTTP server) call only
`add_request`, `abort`, `step`, `has_unfinished` and, at the end, `close`.
"""

import gc
import itertools
import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from rimuru.adjuster import Adjuster, ChangeList
from rimuru.compilation import compile_forward
from rimuru.config import EngineConfig, format_bytes, host_memory
from rimuru.cost_adjuster import CostThresholds
from rimuru.cuda_allocator import use_expandable_segments
from rimuru.expert_manager import ExpertManager
from rimuru.expert_placement import check_budget, initial_offload, least_offload_per_layer
from rimuru.expert_ranking import find_ranking
from rimuru.expert_store import ExpertStore
from rimuru.kv_cache import KVCacheManager
from rimuru.kv_swap import KVSwap, swap_views
from rimuru.linear_state_cache import LinearStateCache
from rimuru.memory import KV, MemoryPool, PageAllocator, fitting_page_tokens, page_sizes_for_model
from rimuru.memory_plan import estimated_reserve, plan_memory
from rimuru.memory_profile import ProfileShapes, profile_step_memory
from rimuru.model_runner import ModelRunner
from rimuru.models import ModelConfig, from_pretrained, parallel
from rimuru.models.checkpoint import resolve_folder
from rimuru.pending_tokens import PendingTokens
from rimuru.pool_adjuster import PoolAdjuster, build_adjuster
from rimuru.popularity import ExpertPopularity
from rimuru.request import Request
from rimuru.sampler import Sampler, logprob_tensors
from rimuru.sampling_params import SamplingParams
from rimuru.scheduler import Scheduler, SchedulerConfig
from rimuru.step_graphs import (
    capture_step_graphs,
    graph_batch_sizes,
    graph_limits,
    graphs_wanted,
    mixed_token_sizes,
    reserve_scratch_page,
)
from rimuru.stop import StopChecker
from rimuru.tensor_parallel import (
    StepMessage,
    broadcast,
    check_message,
    gather_problems,
    graph_setup_message,
    init_rank,
    message_for,
    rendezvous_path,
    replay_message,
    start_workers,
    timeout_s,
)
from rimuru.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger("rimuru")

HOST_MEMORY_WAIT_S = 10.0  # how long a short host-memory reading is re-read before the engine refuses to start


class Engine:
    def __init__(self, config: EngineConfig):
        folder = resolve_folder(config.model)
        model_config = ModelConfig.from_hf(folder)
        requested_max_model_len = config.max_model_len
        config = config.resolve(model_config.max_position_embeddings, model_config.torch_dtype)
        page_tokens = fitting_page_tokens(model_config, config.page_tokens)
        if page_tokens != config.page_tokens:
            logger.warning("KV pages of %d tokens: %d tokens' K and V do not fit in an expert page", page_tokens,
                           config.page_tokens)  # fmt: skip
        self.config = config = replace(config, page_tokens=page_tokens)
        self.device = torch.device(config.device)
        model_config.shard(config.tensor_parallel_size)  # a split the model cannot take: refused before any rank starts
        self.workers = self._start_tensor_parallel(config)  # ranks 1.. of tensor_parallel_size; this process is 0
        try:
            self._build(config, folder, model_config, requested_max_model_len)
        except BaseException:
            self._stop_tensor_parallel()  # an engine that does not start leaves no rank behind
            raise

    def _build(self, config: EngineConfig, folder: str, model_config: ModelConfig,
               requested_max_model_len: int | None) -> None:  # fmt: skip
        check_host_memory(model_config, config.dtype)
        self.async_scheduling = config.async_scheduling is not False and not self.workers
        use_expandable_segments(self.device)  # before the weights: every segment the engine makes is expandable
        self.loaded = from_pretrained(folder, self.device, config.dtype, config.load_format, config.router_skew,
                                      config.progress, config.seed, config.router_regimes)  # fmt: skip
        self.model_config = self.loaded.config
        if config.compile:  # before the memory profile: it and the graphs' warm-ups run the compiled pass
            compile_forward(self.loaded.model, self.model_config.num_hidden_layers)
        self.step_memory = None  # what a step takes outside the pool, where profiled (`rimuru.memory_profile`)
        # tensor parallel ranks replay graphs when asked (their captured all-reduces not yet run on GPUs)
        wants_graphs = graphs_wanted(config.cuda_graphs, self.device) and (config.cuda_graphs or not self.workers)
        self._build_pool(wants_graphs)
        if self.workers:  # every rank's pool is rank 0's size: the same page ids everywhere
            self._broadcast(StepMessage(tensors={"pool_bytes": torch.tensor(self.pool.num_bytes)}))
        scratch_page = reserve_scratch_page(self.allocator) if wants_graphs else None
        self._place_experts(folder)
        device_tables = self.device if wants_graphs else None  # a device copy of the page tables: graphs gather there
        self.kv_cache = KVCacheManager(self.allocator, len(self.model_config.attention_layer_ids), config.page_tokens,
                                       config.max_num_seqs, config.max_model_len, device_tables)  # fmt: skip
        linear_layers = len(self.model_config.linear_layer_ids)
        state_views = self.pool.state_views() if linear_layers else None
        if self.workers and wants_graphs:
            self._start_worker_graphs(scratch_page)
        # tensor parallel graphs are only ever asked for, so a failed capture raises instead of leaving ranks waiting
        graphs = capture_step_graphs(self.loaded.model, self.pool, self.allocator, self.expert_manager,
                                     self.kv_cache.device_tables, scratch_page, config.max_num_seqs,
                                     config.cuda_graphs, config.progress, self._mixed_graph_tokens,
                                     state_views, config.expert_policy == "resident")  # fmt: skip
        self.states = LinearStateCache(self.allocator, linear_layers) if linear_layers else None
        self._fit_max_model_len(requested_max_model_len)
        self.kv_tokens_at_start = self.kv_cache.tokens_in(self.allocator.num_free_small_pages(KV))
        self._log_start_up()
        config = self.config
        scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        swap = None
        if config.preemption == "swap":
            swap = KVSwap(self.kv_cache, swap_views(self.pool, linear_layers > 0), self.pool.num_bytes, self.states)
            swap.log = self.experts.copy_log  # the other ranks repeat each swap in order with the expert copies
        self.scheduler = Scheduler(scheduler_config, self.kv_cache, self._reclaimable_expert_pages, swap, self.states)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, self.pool.kv_view(), self.expert_manager,
                                  graphs, self.states, state_views)  # fmt: skip
        if self.workers:
            self.runner.before_pass, self.runner.before_replay = self._send_pass, self._send_replay
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.in_flight: PendingTokens | None = None  # the last step's tokens, not yet read (async scheduling)
        self.tokenizer = load_tokenizer(config.tokenizer or folder)
        self.stop_checker = StopChecker(self.tokenizer, eos_token_ids(folder, self.model_config))
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.peak_running = 0  # most requests running at once so far
        # host time in the adjuster's round and the cost rule's `observe` and refresh (the refresh overlaps the pass)
        self.adjuster_seconds = 0.0
        self.step_phases: dict[str, float] = {}  # the last step's wall seconds by phase (`_PhaseClock`)
        self.closed = False

    def _start_tensor_parallel(self, config: EngineConfig) -> list:
        """The other ranks' processes, started before this one loads its shard (they load theirs meanwhile)."""
        size = config.tensor_parallel_size
        if size == 1:
            return []
        rendezvous = rendezvous_path()
        workers = start_workers(config, size, rendezvous)
        init_rank(0, size, rendezvous, self.device)
        logger.info("tensor parallel over %d %s ranks", size, self.device.type)
        return workers

    def _send_pass(self, input_ids: torch.Tensor, ctx) -> None:
        """Every rank's pass: the expert copies since the last one, then this pass's inputs and page tables."""
        self._broadcast(message_for(self.experts.copy_log, input_ids, ctx))
        self.experts.copy_log.clear()

    def _send_replay(self, inputs, shape, table_entries, expert_tables) -> None:
        """Every rank's replay of a captured step: the expert copies since the last pass, then the step."""
        self._broadcast(replay_message(self.experts.copy_log, inputs, shape, table_entries, expert_tables))
        self.experts.copy_log.clear()

    def check_rank_tables(self) -> None:
        """Debug: every rank's expert pages hold the experts rank 0's tables place there, and its graphs' mirrors
        equal rank 0's tables; AssertionError naming the differences. A no-op on one rank."""
        if not self.workers:
            return
        graphs = self.runner.graphs is not None
        working = self.expert_manager.loader.working_tables
        kv_tables = self.kv_cache.device_tables if graphs else None
        self._broadcast(check_message(self.experts.copy_log, self.experts.host_tables, working, kv_tables))
        self.experts.copy_log.clear()
        problems = [f"rank {rank}: {p}" for rank, found in enumerate(gather_problems([])) for p in found]
        assert not problems, "tensor parallel ranks disagree: " + "; ".join(problems[:5])

    def _start_worker_graphs(self, scratch_page: int) -> None:
        """The other ranks capture the step graphs rank 0 is about to capture, with the experts placed so far."""
        tables = self.expert_manager.pass_routing(fixed_tables=True)[0]
        sizes, mixed = graph_batch_sizes(self.config.max_num_seqs), mixed_token_sizes(self._mixed_graph_tokens)
        self._broadcast(graph_setup_message(self.experts.copy_log, self.kv_cache.device_tables, tables, scratch_page,
                                            sizes, mixed))  # fmt: skip
        self.experts.copy_log.clear()

    def _broadcast(self, message: StepMessage) -> None:
        """`message` to every rank; a rank that died or hangs fails it in one line naming the ranks gone."""
        try:
            broadcast(message)
        except (RuntimeError, dist.DistBackendError) as error:
            stopped = [f"rank {i} (exit code {w.exitcode})" for i, w in enumerate(self.workers, 1) if not w.is_alive()]
            raise RuntimeError(f"tensor parallel: {', '.join(stopped) or 'a rank'} stopped answering ({error}); "
                               "restart the engine") from error  # fmt: skip

    def _log_start_up(self) -> None:
        """One line a user can read: where the weights are, the KV tokens and what they hold, the budget used."""
        plan, budget, experts = self.memory_plan, self.memory_plan.budget_bytes, self.experts
        reserve = "profiled" if self.step_memory is not None else "estimated"
        most_on_host = max((len(on_host) for on_host in experts.offloaded.values()), default=0)
        full_length = self.kv_tokens_at_start // self.config.max_model_len
        logger.info("weights %.2f GiB on %s; experts %d in the pool, %d on the host (at most %d a layer); KV "
                    "cache for %d tokens (%d requests of max_model_len %d at once); %.0f MiB %s for steps; pool "
                    "%.2f GiB%s",
                    plan.weights_bytes / 2**30, self.device.type, experts.num_resident, experts.num_offloaded,
                    most_on_host, self.kv_tokens_at_start, full_length, self.config.max_model_len,
                    plan.activation_bytes / 2**20, reserve, self.pool.num_bytes / 2**30,
                    "" if budget is None else f" of a {budget / 2**30:.2f} GiB budget")  # fmt: skip

    def _fit_max_model_len(self, requested: int | None) -> None:
        """Make sure one sequence of max_model_len tokens, and a hybrid's state beside it, fits the pool (once the
        adjuster evicted all it may), so a budget can never cut an output short: lower an implicit max_model_len with a warning; refuse an explicit one.
        """
        reclaimable_kv = self._reclaimable_expert_pages(stalled=True) * self.allocator.children[KV]
        state_kv = 0 if self.states is None else self.states.expert_pages_for_requests(1) * self.allocator.children[KV]
        capacity = self.kv_cache.tokens_in(max(0, self.allocator.num_free_small_pages(KV) + reclaimable_kv - state_kv))
        if capacity >= self.config.max_model_len:
            return
        if requested is not None or capacity < 1:
            raise ValueError(
                f"max_model_len {self.config.max_model_len} needs KV cache for {self.config.max_model_len} tokens in "
                f"every layer but the pool holds {capacity}; raise gpu_memory_budget{self._budget_for(capacity)} or "
                f"lower max_model_len"
            )
        logger.warning("the KV pool holds %d tokens a sequence: max_model_len lowered from %d",
                       capacity, self.config.max_model_len)  # fmt: skip
        self.config = replace(self.config, max_model_len=capacity)

    def _budget_for(self, capacity: int) -> str:
        """' to at least X': the budget whose pool holds one sequence of max_model_len ('' without a budget)."""
        if self.config.gpu_memory_budget is None:
            return ""
        sizes, layers = self.pool.sizes, len(self.model_config.attention_layer_ids)
        missing_pages = (-(-(self.config.max_model_len - capacity) // sizes.page_tokens) + 1) * layers
        expert_pages = -(-missing_pages // sizes.kv_pages_per_expert_page)
        return f" to at least {format_bytes(self.config.gpu_memory_budget + expert_pages * sizes.expert_page_bytes)}"

    @property
    def _mixed_graph_tokens(self) -> int:
        """The token limit mixed steps' graphs are captured up to (0: decode graphs only; a hybrid model's always)."""
        mixed = self.config.mixed_cuda_graphs and not self.loaded.config.linear_layer_ids
        return self.config.max_num_batched_tokens if mixed else 0

    def _build_pool(self, wants_graphs: bool) -> None:
        cfg, mc = self.config, self.loaded.config
        sizes = page_sizes_for_model(mc, cfg.dtype, cfg.page_tokens)
        for note in sizes.notes:
            logger.warning(note)
        weights = _device_bytes(self.loaded.model)
        expert_bytes = len(mc.moe_layer_ids) * mc.num_experts * 3 * sizes.expert_page_bytes
        self.memory_plan = plan_memory(self.device, cfg.gpu_memory_budget, weights, expert_bytes,
                                       self._step_reserve(sizes, wants_graphs), sizes.expert_page_bytes)  # fmt: skip
        self.pool = MemoryPool(sizes, self.memory_plan.pool_bytes, self.device)
        self.allocator = PageAllocator(sizes, self.pool.num_bytes)

    def _step_reserve(self, sizes, wants_graphs: bool) -> int:
        """Bytes a step takes outside the pool: profiled on a GPU (`rimuru.memory_profile`), estimated elsewhere."""
        cfg, mc = self.config, self.loaded.config
        captured = wants_graphs and self.device.type == "cuda"  # real graphs keep a memory pool of their own
        graph_seqs, graph_tokens = graph_limits(cfg.max_num_seqs, self._mixed_graph_tokens) if captured else (0, 0)
        # the profile pass has no state pages for a hybrid yet, and would run on one rank of a tensor parallel group
        if self.device.type != "cuda" or mc.linear_layer_ids or self.workers:
            if self.device.type == "cuda":
                logger.warning("the step memory of %r is estimated, not profiled: keep a margin in "
                               "gpu_memory_budget", mc.architecture)  # fmt: skip
            return estimated_reserve(mc, self.device, cfg.dtype, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                     graph_seqs, graph_tokens)  # fmt: skip
        mixed_tokens = graph_tokens if graph_tokens > graph_seqs else 0
        # a step with a prompt chunk replays a graph only up to the largest mixed shape; a decode one up to top
        every_step_captured = captured and cfg.max_num_seqs <= graph_seqs and cfg.max_num_batched_tokens <= mixed_tokens
        shapes = ProfileShapes(decode_batch=graph_seqs, mixed_tokens=mixed_tokens,
                               eager_tokens=0 if every_step_captured else cfg.max_num_batched_tokens,
                               max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len)  # fmt: skip
        self.step_memory = profile_step_memory(self.loaded.model, sizes, shapes, mc.num_hidden_layers,
                                               mc.num_experts, self.device)  # fmt: skip
        return self.step_memory.reserve_bytes

    def _place_experts(self, folder: str) -> None:
        """Host store, ranking, loading buffers and the start-up placement of the configured policy."""
        cfg, mc = self.config, self.model_config
        self.experts = ExpertStore(self.loaded.experts, mc.num_hidden_layers, self.pool, self.allocator)
        if self.workers:
            self.experts.copy_log = []  # each step's copies go to the other ranks (`_send_pass`)
        count = cfg.offload_count(mc.num_experts)
        direct = cfg.expert_reads == "direct"
        if cfg.expert_policy == "elastic" and cfg.expert_offload_limit is None and not direct:
            count = least_offload_per_layer(self.experts, count)
        buffer_experts = 0 if direct else count  # direct reads need no loading buffers
        outside_pool = None if cfg.gpu_memory_budget is None else cfg.gpu_memory_budget - self.pool.num_bytes
        check_budget(cfg.expert_policy, count, self.experts, self.pool.num_bytes, buffer_experts, outside_pool)
        ranking = find_ranking(folder, cfg.expert_ranking, mc.moe_layer_ids, mc.num_experts)
        is_cost = cfg.expert_policy == "elastic" and cfg.adjuster == "cost"
        # async scheduling: the cost rule reads its counts while the next pass runs, so one read late
        lagged = self.async_scheduling
        popularity = ExpertPopularity(ranking, mc.num_experts, self.device, lagged=lagged) if is_cost else None
        routers = {layer: self.loaded.model.model.layers[layer].mlp.gate.weight for layer in mc.moe_layer_ids}
        self.expert_manager = ExpertManager(self.experts, buffer_experts, routers, mc.num_experts_per_tok,
                                            cfg.prefetch and not direct, popularity, direct)  # fmt: skip
        self.experts.place(initial_offload(cfg.expert_policy, count, self.experts, Adjuster(ranking, count)))
        if ranking.is_uniform and (self.experts.num_offloaded or (count and not is_cost)):  # the cost rule counts live
            logger.warning("no expert_ranking.json: experts are offloaded in id order; run `rimuru profile` first")
        self.adjuster: PoolAdjuster | None = None  # built after the placement, whose copies are its first sample
        if cfg.expert_policy == "elastic":
            thresholds = CostThresholds(copy_compute_ratio=cfg.copy_compute_ratio, ttft_slo=cfg.ttft_slo)
            counter = self.expert_manager.counter
            reads = (counter.lagged_direct_reads() if lagged else counter.direct_reads) if direct else None
            self.adjuster = build_adjuster(cfg.adjuster, ranking, count, popularity, self.experts,
                                           mc.num_experts_per_tok, thresholds, reads, self.allocator.children[KV])

    def _reclaimable_expert_pages(self, stalled: bool) -> int:
        """Expert pages the adjuster could still free by evicting this round (0 unless elastic); `stalled` (the
        scheduler's word: at most one request running) overrides the cost rule."""
        if self.adjuster is None:
            return 0
        return self.adjuster.reclaimable_experts(self.experts.offloaded, stalled) * 3

    @property
    def expert_stats(self) -> dict:
        """Counters of expert traffic plus the pool split now, for metrics and the dashboard."""
        buffer_pages = sum(len(b.slots) for b in self.expert_manager.loader.buffers) * 3
        estimates = {} if self.adjuster is None else self.adjuster.estimates  # the rule's model: why the pool moved
        return self.expert_manager.stats_dict() | self.allocator.stats() | estimates | {
            "buffer_pages": buffer_pages,  # loading buffers, counted in expert_used_pages too
            "offloaded_experts": self.experts.num_offloaded,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }

    # ---- requests ----------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be a non-empty list of ints in [0, {self.model_config.vocab_size})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[Request]:
        """Queue a prompt; returns its `params.n` sequences. ValueError for a prompt that cannot be served."""
        self._check_open()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, max_tokens = self.validate(prompt, params)
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        sequences = [Request(sid, token_ids, params, max_tokens, self._generator(params, i)) for i, sid in enumerate(ids)]
        for sequence in sequences:
            self.requests[sequence.request_id] = sequence
            self.scheduler.add(sequence)
        return sequences

    def validate(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], int]:
        """(prompt token ids, output tokens allowed) or ValueError saying why the prompt cannot be served. Pure."""
        token_ids = self.tokenize(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        return token_ids, self._max_tokens(len(token_ids), params)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        context = self.config.max_model_len
        if prompt_len >= context:
            raise ValueError(f"the prompt has {prompt_len} tokens but the model's context is {context} tokens")
        return min(params.max_tokens or context, context - prompt_len)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed + index)

    def abort(self, request_id: str) -> None:
        """Stop a request (and its pages) now; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return not self.closed and (self.scheduler.has_unfinished() or self.in_flight is not None)

    # ---- closing -----------------------------------------------------------------------------------------------

    # what holds the pool, the graphs' memory, the weights and the pinned host experts
    _HOLDERS = ("in_flight", "runner", "scheduler", "kv_cache", "expert_manager", "adjuster", "experts", "allocator",
                "pool", "loaded")

    def close(self) -> None:
        """Give the GPU memory (pool, CUDA graphs, weights) and the pinned host experts back now, unfinished requests
        dropped; any later request or step raises RuntimeError. Without it they go only when the garbage collector
        finds the engine's reference cycles. Closing twice does nothing."""
        if self.closed:
            return
        self.closed = True
        self._stop_tensor_parallel()
        self.requests.clear()
        for name in self._HOLDERS:
            setattr(self, name, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _stop_tensor_parallel(self) -> None:
        if not self.workers:
            return
        try:
            broadcast(StepMessage(stop=True))
        except (RuntimeError, dist.DistBackendError):  # a rank already gone: the others are stopped below
            pass
        for worker in self.workers:
            worker.join(timeout=timeout_s())
            if worker.is_alive():
                worker.kill()
        dist.destroy_process_group()
        parallel.init(0, 1)
        self.workers = []

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed")

    # ---- the loop ----------------------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One scheduling round; returns the requests that got a token or finished (finished ones are forgotten).
        With async scheduling the tokens returned are the round before's, read once this round's pass is queued."""
        self._check_open()
        clock = _PhaseClock()
        batch = self.scheduler.schedule()
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        clock.lap("schedule")
        changes = self._adjust(batch.kv_shortfall_pages)
        self.adjuster_seconds += clock.lap("adjust")
        self.expert_manager.begin_step(changes)
        try:
            return self._run(batch)
        finally:
            # the copies issued, the pass and sampling (which waits for the GPU), then the deferred expert changes
            step_seconds = clock.lap("forward")
            self.expert_manager.end_step()
            step_seconds += clock.lap("expert_changes")
            if self.scheduler.swap is not None:  # what a recompute would cost, for the next preemption
                self.scheduler.swap.cost.observe_step(step_seconds, batch.num_tokens, len(batch.requests))
            if self.adjuster is not None:  # the step's wall time: forward, sampling, expert copies
                self.adjuster.observe(step_seconds, batch.num_tokens, self.scheduler.waiting,
                                      len(self.scheduler.running), self.allocator.num_used_pages(KV))
                self.adjuster_seconds += clock.lap("observe")
            self.step_phases = clock.phases

    def _adjust(self, kv_shortfall_pages: int) -> ChangeList:
        if self.adjuster is None:
            return ChangeList()
        short = self.allocator.expert_pages_for(kv_shortfall_pages)
        free = self.allocator.num_free_expert_pages
        if free:  # pages the running batch is forecast to fill are not the experts' to grow into
            free = max(0, free - self._expert_pages_for_growth())
        return self.adjuster.adjust(short, free, self.experts.offloaded, self.scheduler.stalled)

    def _expert_pages_for_growth(self) -> int:
        """Free expert pages the running batch's forecast growth needs beyond the free KV pages already split off."""
        allocator = self.allocator
        split_free = allocator.num_free_small_pages(KV) - allocator.num_free_expert_pages * allocator.children[KV]
        return self.allocator.expert_pages_for(self.scheduler.growth_pages() - split_free)

    def _run(self, batch) -> list[Request]:
        """The round's pass and sampling; then the tokens of the round before (async scheduling) and, unless this
        round's stay on the device for the next, this round's."""
        pending, self.in_flight = self.in_flight, None
        sampled, tokens, logprobs = [], [], []
        if batch.requests:
            logits, rows = self.runner.execute(batch, pending)  # [B', V]
            self._while_the_pass_runs()
            for request, num_new in zip(batch.requests, batch.num_new_tokens):
                request.num_computed_tokens += num_new
            sampled = [batch.requests[row] for row in rows]
            if self.async_scheduling:
                sampled_tokens = self.sampler.sample(logits, sampled)
                found = logprob_tensors(logits, sampled, sampled_tokens)
                self.in_flight = PendingTokens(sampled, sampled_tokens, found)
            else:
                tokens, logprobs = self.sampler(logits, sampled)
            self.num_steps += 1
        updated = [] if pending is None else self._take(pending.requests, *pending.wait())
        return updated if self.in_flight is not None else updated + self._take(sampled, tokens, logprobs)

    def _take(self, requests: list[Request], tokens: list[int], logprobs: list) -> list[Request]:
        """Each request's new token, but for requests finished since it was sampled (a token of the round before
        ended them, or an abort): the ones that took theirs."""
        taken = []
        for request, token, logprob in zip(requests, tokens, logprobs):
            if not request.is_finished:
                self._append(request, token, logprob)
                taken.append(request)
        return taken

    def _while_the_pass_runs(self) -> None:
        """Host work that needs nothing of the pass just launched, done before the sampler waits for it: on a GPU it
        costs the step nothing (on the CPU the pass has already run)."""
        if self.adjuster is not None:
            start = time.perf_counter()
            self.adjuster.refresh_if_due()
            self.adjuster_seconds += time.perf_counter() - start

    def _append(self, request: Request, token: int, logprob: dict[int, float] | None) -> None:
        request.output_token_ids.append(token)
        if logprob is not None:
            request.logprobs = (request.logprobs or []) + [logprob]
        reason, stop_reason = self.stop_checker.check(request)
        if reason is not None:
            request.stop_reason = stop_reason
            self.scheduler.finish(request, reason)
            self.requests.pop(request.request_id, None)


class _PhaseClock:
    """Wall seconds of a step's phases, each from the end of the one before: `lap(name)` closes a phase."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.phases[name], self._last = now - self._last, now
        return self.phases[name]


def check_host_memory(config: ModelConfig, dtype: torch.dtype) -> None:
    """ValueError before loading when the host store of every routed expert does not fit the RAM available."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    needed = len(config.moe_layer_ids) * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    needed *= itemsize
    available = _host_memory_within(needed, HOST_MEMORY_WAIT_S)
    if needed > available:
        raise ValueError(f"the routed experts need {needed / 2**30:.2f} GiB of host memory (they are kept there, "
                         f"pinned), but {available / 2**30:.2f} GiB is available")  # fmt: skip


def _host_memory_within(needed: int, wait_s: float) -> int:
    """Available host RAM, re-read for up to `wait_s` while short: a process that just ended (an earlier run, a
    benchmark's previous engine) hands its pinned memory back over seconds."""
    deadline = time.monotonic() + wait_s
    available = host_memory(available=True)
    while available < needed and time.monotonic() < deadline:
        time.sleep(0.5)
        available = host_memory(available=True)
    return available


def _device_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (an fp32 router buffer may alias its weight)."""
    tensors = {t.untyped_storage().data_ptr(): t for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())
