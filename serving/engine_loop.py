"""`EngineLoop`: the one thread that touches the `Engine`, and the hand-off between it and the event loop.

    event loop (handlers)                     engine thread
    submit(Submission) --commands queue-->    tokenize / chat template, add_request
    abort(request_id)  --commands queue-->    engine.abort: its pages return to the pool
    await sub.queue    <--call_soon_threadsafe-- Accepted | Rejected, then [Delta, ...] each step

A submission is one HTTP request: one or more prompts times `n` sequences, each a *choice* with an index.
Detokenising happens here too (the tokenizer is engine state), through each `Choice`. Metrics and the memory
timeline are updated here, after each step.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

from rimuru.engine import Engine
from rimuru.request import Request
from rimuru.serving.choice import Choice, Delta
from rimuru.serving.metrics import Metrics, read_expert_stats
from rimuru.serving.submission import Accepted, Rejected, Submission
from rimuru.serving.timeline import Timeline, adjuster_state, pool_split

logger = logging.getLogger("rimuru.serving")
IDLE_WAIT_S = 0.25  # an idle engine thread wakes this often to record a sample


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], metrics: Metrics, timeline: Timeline):
        """`make_engine` runs on the engine thread, so no other thread ever touches the engine, its construction
        (CUDA streams, the current device) included."""
        self.make_engine, self.metrics, self.timeline = make_engine, metrics, timeline
        self.engine: Engine | None = None
        self.max_model_len = self.pool_bytes = 0  # copied out at start for the event loop's routes
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._choices: dict[str, Choice] = {}  # engine request id -> choice
        self._by_submission: dict[str, list[Choice]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rimuru-engine", daemon=True)

    # ---- any thread --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (once) and wait until it has built the engine; re-raises what building it raised."""
        if not self._thread.is_alive() and not self._ready.is_set():
            self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def submit(self, submission: Submission) -> None:
        self._commands.put(("add", submission))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    # ---- the engine thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self.make_engine()
            self.max_model_len, self.pool_bytes = self.engine.config.max_model_len, self.engine.memory_plan.pool_bytes
            self._record(force=True)
        except BaseException as error:  # noqa: BLE001 - handed to start()
            self._start_error = error
            return
        finally:
            self._ready.set()
        while not self._stopping.is_set():
            try:
                self._round()
            except Exception:
                logger.exception("engine loop round failed")
                time.sleep(0.01)
        self.engine.close()  # on this thread, the only one that touches the engine

    def _round(self) -> None:
        self._drain(block=not self.engine.has_unfinished())
        if self.engine.has_unfinished():
            self._step()
            self._record(force=not self.engine.has_unfinished())  # the idle state shows at once
        else:
            self._record(force=False)

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "abort":
            self._abort(command[1], post=False)
        elif kind == "abort_all":
            for request_id in list(self._by_submission):
                self._abort(request_id, post=True)

    def _add(self, sub: Submission) -> None:
        added: list[Request] = []
        try:
            prompts = [self._chat_prompt(sub)] if sub.messages is not None else [self._tokens(p) for p in sub.prompts]
            for p, token_ids in enumerate(prompts):
                request_id = sub.request_id if len(prompts) == 1 else f"{sub.request_id}-p{p}"
                added += self.engine.add_request(request_id, token_ids, sub.params)
        except Exception as error:  # any failure rejects this request, never the thread
            for request in added:
                self.engine.abort(request.request_id)
            if not isinstance(error, ValueError):
                logger.exception("could not add request %s", sub.request_id)
            _post(sub, Rejected(error))
            return
        choices = [Choice(sub, i, request) for i, request in enumerate(added)]
        self._by_submission[sub.request_id] = choices
        self._choices.update((c.request.request_id, c) for c in choices)
        self.metrics.prompt_tokens.inc(sum(len(t) for t in prompts))
        _post(sub, Accepted([len(t) for t in prompts]))

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        token_ids = self.engine.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        return token_ids

    def _chat_prompt(self, sub: Submission) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        try:
            token_ids = tokenizer.apply_chat_template(sub.messages, add_generation_prompt=sub.add_generation_prompt)
        except Exception as error:  # a template may raise anything on odd input
            raise ValueError(f"messages: the chat template failed: {error}") from error
        if isinstance(token_ids, Mapping):  # transformers 5 returns a BatchEncoding
            token_ids = token_ids["input_ids"]
        return self._tokens(list(token_ids))

    def _abort(self, request_id: str, post: bool) -> None:
        choices = self._abort_choices(self._by_submission.pop(request_id, []))
        if post and choices:
            _post(choices[0].submission, [Delta(c.index, "", [], finish_reason="abort", full_text="") for c in choices])

    def _step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception as error:  # fail the requests in flight, keep serving
            logger.exception("engine step failed")
            for request_id in list(self._by_submission):
                choices = self._by_submission.pop(request_id)
                self._abort_choices(choices)
                _post(choices[0].submission, Rejected(error))
            return
        now = time.monotonic()
        deltas: dict[str, tuple[Submission, list[Delta]]] = {}
        for request in updated:
            choice = self._choices.get(request.request_id)
            if choice is not None:
                delta = self._delta(choice, now)
                deltas.setdefault(choice.submission.request_id, (choice.submission, []))[1].append(delta)
        for sub, items in deltas.values():
            _post(sub, items)

    def _abort_choices(self, choices: list[Choice]) -> list[Choice]:
        """Abort the unfinished ones (their pages return to the pool); returns those."""
        unfinished = [c for c in choices if not c.request.is_finished]
        for choice in unfinished:
            self.engine.abort(choice.request.request_id)
            self._choices.pop(choice.request.request_id, None)
            self.metrics.finished("abort")
        return unfinished

    def _delta(self, choice: Choice, now: float) -> Delta:
        num_before = choice.num_sent_tokens
        delta = choice.delta(self.engine.stop_checker, self.engine.tokenizer)
        self._observe_tokens(choice, choice.num_sent_tokens - num_before, now)
        if choice.request.is_finished:
            self._finish(choice, now)
        return delta

    def _observe_tokens(self, choice: Choice, count: int, now: float) -> None:
        if count == 0:
            return
        if choice.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - choice.submission.arrival)
        else:
            self.metrics.time_per_output_token.observe(now - choice.last_token_time)
        choice.last_token_time = now
        self.metrics.generation_tokens.inc(count)
        self.timeline.add_tokens(count)

    def _finish(self, choice: Choice, now: float) -> None:
        self._choices.pop(choice.request.request_id, None)
        self.metrics.e2e_request_latency.observe(now - choice.submission.arrival)
        self.metrics.finished(choice.request.finish_reason)
        request_id = choice.submission.request_id
        if all(c.request.is_finished for c in self._by_submission.get(request_id, [])):
            self._by_submission.pop(request_id, None)

    def _record(self, force: bool) -> None:
        if not force and not self.timeline.is_due():
            return
        allocator, scheduler = self.engine.allocator, self.engine.scheduler
        split = pool_split(allocator.stats())
        obtainable = allocator.num_free_small_pages() if hasattr(allocator, "num_free_small_pages") else 0
        kv_usage = split["kv_pages"] / max(1, split["kv_pages"] + obtainable)
        stats = read_expert_stats(self.engine)
        self.metrics.update_engine(self.engine, split, kv_usage, stats)
        sample = split | {"kv_usage": kv_usage} | adjuster_state(stats)
        self.timeline.record(sample, len(scheduler.running), len(scheduler.waiting))


def _post(sub: Submission, item) -> None:
    """Hand `item` to the submission's asyncio queue from the engine thread; a closed loop means nobody waits."""
    try:
        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)
    except RuntimeError:
        pass
