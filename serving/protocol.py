"""The OpenAI request bodies as msgspec structs, and their translation into `SamplingParams`.

Owns the wire names and the schema constraints the OpenAPI document advertises. Range checks that
`SamplingParams` already makes are not repeated here: its ValueError (naming the field) becomes a 400.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rimuru.sampling_params import SamplingParams

MAX_N = 128
MAX_SEED = 2**63 - 1 - MAX_N  # seeded sequences use seed + index; torch takes [-2**63, 2**64)

PositiveInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=MAX_SEED)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share, with vLLM's names and defaults."""

    model: str | None = None  # None: the served model
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    # NOTE: non-optional with defaults: Litestar drops zero-valued bounds of optional fields from the OpenAPI schema
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        """ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of those (one choice group each)."""

    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    logprobs: TopLogprobs | None = None
    return_token_ids: bool = False  # vLLM's extension: every choice and chunk carries its new token ids

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; ValueError when the list mixes token ids with other prompts."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        is_ids = [isinstance(p, int) for p in self.prompt]
        if all(is_ids):
            return [list(self.prompt)]
        if any(is_ids):
            raise ValueError("prompt must be a string, a list of token ids, or a list of strings or token-id lists")
        return list(self.prompt)


class ContentPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        return message | ({"name": self.name} if self.name is not None else {})


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name for `max_tokens`."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    # accepted so that asking for them gets a clear 400 rather than being ignored: no tool calls, no JSON mode yet
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def num_logprobs(self) -> int | None:
        """The top log-probabilities asked for (None: none); ValueError for what Rimuru does not do."""
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools and tool_choice are not supported: Rimuru does not produce tool calls")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported; only 'text'")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail
