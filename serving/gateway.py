"""`Gateway`: admission, submission and the life of one HTTP generation request on the event loop.

`Gateway.start` admits (429 when the server holds `max_queued_requests`, 503 while draining), submits to the
engine loop and waits for the engine's verdict, so a rejected request fails before any byte of a 200 is sent.
`Generation.close` is idempotent and always runs (stream end, client gone, error): it aborts what is unfinished,
so the pages return to the pool, and gives the admission slot back.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rimuru.sampling_params import SamplingParams
from rimuru.serving.choice import Delta
from rimuru.serving.engine_loop import EngineLoop
from rimuru.serving.errors import OpenAIError
from rimuru.serving.submission import Accepted, Rejected, Submission


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_path: str
    api_key: str | None = None
    max_queued_requests: int | None = None  # requests in the server at once (running and waiting); None: no limit
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 8 * 2**20

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class Generation:
    def __init__(self, gateway: "Gateway", submission: Submission, accepted: Accepted):
        self.gateway, self.submission = gateway, submission
        self.prompt_tokens = sum(accepted.prompt_token_counts)
        self.num_left = submission.num_choices
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Each engine step's deltas until every choice has finished; OpenAIError(500) if the engine failed."""
        while self.num_left > 0:
            item = await self.submission.queue.get()
            if isinstance(item, Rejected):
                self.num_left = 0
                raise OpenAIError(500, f"the engine failed: {type(item.error).__name__}: {item.error}")
            self.num_left -= sum(d.finish_reason is not None for d in item)
            yield item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.num_left > 0:
            self.gateway.engine_loop.abort(self.request_id)
        self.gateway.release()


class Gateway:
    def __init__(self, engine_loop: EngineLoop, settings: ServerSettings):
        self.engine_loop, self.settings = engine_loop, settings
        self.num_in_flight = 0
        self.is_draining = False

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.settings.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return self.settings.model_name

    def _admit(self) -> None:
        if self.is_draining:
            raise OpenAIError(503, "the server is shutting down and admits no new requests")
        limit = self.settings.max_queued_requests
        if limit is not None and self.num_in_flight >= limit:
            message = f"the server already holds {self.num_in_flight} requests (--max-queued-requests {limit})"
            raise OpenAIError(429, message + "; retry later")
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

    async def start(self, prefix: str, params: SamplingParams, prompts: list | None = None,
                    messages: list[dict] | None = None, add_generation_prompt: bool = True) -> Generation:  # fmt: skip
        """Admit and submit; returns once the engine accepted, raises OpenAIError when it did not."""
        self._admit()
        loop = asyncio.get_running_loop()
        submission = Submission(f"{prefix}-{uuid.uuid4().hex}", prompts or [], params, loop, asyncio.Queue(),
                                messages, add_generation_prompt)  # fmt: skip
        try:
            self.engine_loop.submit(submission)
            verdict = await submission.queue.get()
        except BaseException:
            self.engine_loop.abort(submission.request_id)  # cancelled while the engine decided
            self.release()
            raise
        if isinstance(verdict, Rejected):
            self.release()
            if isinstance(verdict.error, ValueError):
                raise OpenAIError.bad_request(verdict.error)
            raise OpenAIError(500, f"the engine could not add the request: {type(verdict.error).__name__}")
        return Generation(self, submission, verdict)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, wait up to `timeout` seconds for requests in flight; True when all finished."""
        self.is_draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.num_in_flight == 0
