"""`Request`: one sequence's tokens and progress through the engine. Mutated only by the scheduler and engine."""

import enum
from dataclasses import dataclass, field

import torch

from rimuru.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # output tokens allowed: the params' max_tokens capped by the context
    generator: torch.Generator | None = None  # seeded requests sample from their own generator
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # tokens sampled on the device and not yet on the host (async scheduling: the next step is scheduled and
    # launched first, its input ids taken from the device): counted in num_tokens, not yet in output_token_ids
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    waiting_since: float = 0.0  # time.monotonic() when it last joined the waiting queue (set by the scheduler)
    detokenizer: object | None = None  # the output text so far (an IncrementalDetokenizer), made by StopChecker

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens on the host: the prompt and the outputs so far, not the pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def reaches_max_tokens(self) -> bool:
        """Its pending tokens bring it to `max_tokens`: it finishes when they arrive, so no step computes past them."""
        return self.num_pending_tokens > 0 and len(self.output_token_ids) + self.num_pending_tokens >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output; a pending token (one not yet on the host) reads as 0."""
        known = self.num_known_tokens
        if self.num_pending_tokens and end > known:  # the step's input ids for these come from the device
            return self.token_ids(min(start, known), known) + [0] * (min(end, self.num_tokens) - max(start, known))
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:  # a decode step: no copy of the whole sequence
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
