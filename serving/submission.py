"""`Submission`: one HTTP generation request handed to the engine thread, and the engine's verdict on it.

The event loop creates it and then only reads its asyncio queue; the engine thread fills the queue, first with
`Accepted` or `Rejected`, then with each step's list of `Delta`s.
"""

import asyncio
import time
from dataclasses import dataclass, field

from rimuru.sampling_params import SamplingParams


@dataclass(eq=False)
class Submission:
    request_id: str
    prompts: list[str | list[int]]  # ignored when `messages` is given
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    messages: list[dict] | None = None  # chat: rendered with the tokenizer's chat template on the engine thread
    add_generation_prompt: bool = True
    arrival: float = field(default_factory=time.monotonic)

    @property
    def num_choices(self) -> int:
        return self.params.n * (1 if self.messages is not None else len(self.prompts))


@dataclass
class Accepted:
    prompt_token_counts: list[int]


@dataclass
class Rejected:
    error: Exception
