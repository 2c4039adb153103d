"""POST /v1/completions and /v1/chat/completions: validate, start a generation, answer whole or as SSE chunks.

Everything that can reject a request (body, model name, sampling parameters, prompt length, admission) happens
before the response starts. A streaming client that goes away cancels the stream (Litestar listens for the
disconnect); a non-streaming one is watched for the same while its answer is gathered. Either way the generation
is closed, which aborts it in the engine.
"""

import asyncio

import msgspec
from litestar import Request, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from rimuru.serving.errors import OpenAIError
from rimuru.serving.gateway import Gateway, Generation
from rimuru.serving.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from rimuru.serving.responses import ChatFormatter, CompletionFormatter, Formatter

DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's and OpenAI's default for /v1/completions
_ERROR_SPEC = {code: ResponseSpec(ErrorResponse, description=text) for code, text in (
    (400, "invalid parameters or a prompt longer than the context"), (401, "wrong or missing API key"),
    (404, "unknown model"), (413, "body too large"), (429, "too many requests queued"), (503, "shutting down"),
)}  # fmt: skip


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _params(make):
    try:
        return make()
    except ValueError as error:
        raise OpenAIError.bad_request(error) from None


@post("/completions", status_code=200, responses=_ERROR_SPEC, summary="Create a completion")
async def create_completion(data: CompletionRequest, request: Request) -> Response:
    gateway = _gateway(request)
    model = gateway.check_model(data.model)
    prompts = _params(data.prompts)
    params = _params(lambda: data.sampling_params(data.logprobs, data.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS))
    generation = await gateway.start("cmpl", params, prompts=prompts)
    formatter = CompletionFormatter(generation.request_id, model, generation.submission.num_choices,
                                    data.return_token_ids)  # fmt: skip
    return await _answer(generation, formatter, data.stream, data.include_usage, request)


@post("/chat/completions", status_code=200, responses=_ERROR_SPEC, summary="Create a chat completion")
async def create_chat_completion(data: ChatCompletionRequest, request: Request) -> Response:
    gateway = _gateway(request)
    model = gateway.check_model(data.model)
    max_tokens = data.max_completion_tokens or data.max_tokens
    params = _params(lambda: data.sampling_params(data.num_logprobs(), max_tokens))
    generation = await gateway.start("chatcmpl", params, messages=data.template_messages(),
                                     add_generation_prompt=data.add_generation_prompt)  # fmt: skip
    formatter = ChatFormatter(generation.request_id, model, generation.submission.num_choices)
    return await _answer(generation, formatter, data.stream, data.include_usage, request)


async def _answer(generation: Generation, formatter: Formatter, stream: bool, include_usage: bool,
                  request: Request) -> Response:  # fmt: skip
    formatter.prompt_tokens = generation.prompt_tokens
    if stream:
        return Stream(_sse(generation, formatter, include_usage), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                      background=BackgroundTask(generation.close))  # fmt: skip
    try:
        await _gather_unless_disconnected(generation, formatter, request)
    finally:
        generation.close()
    return Response(formatter.response(), status_code=200)


# characters JSON carries raw but line splitters such as Python's str.splitlines break an event at
_LINE_BREAKS = {"\u0085".encode(): b"\\u0085", "\u2028".encode(): b"\\u2028", "\u2029".encode(): b"\\u2029"}


def sse_json(value) -> bytes:
    """JSON for one server-sent event's data line, with the Unicode line breaks escaped."""
    data = msgspec.json.encode(value)
    for raw, escaped in _LINE_BREAKS.items():
        data = data.replace(raw, escaped)
    return data


async def _sse(generation: Generation, formatter: Formatter, include_usage: bool):
    encode = sse_json
    try:
        async for deltas in generation.deltas():
            for chunk in formatter.chunks(deltas, include_usage):
                yield b"data: " + encode(chunk) + b"\n\n"
        if include_usage:
            yield b"data: " + encode(formatter.usage_chunk()) + b"\n\n"
    except OpenAIError as error:
        body = {"error": {"message": error.message, "type": "server_error", "param": None, "code": None}}
        yield b"data: " + encode(body) + b"\n\n"
    finally:
        generation.close()
    yield b"data: [DONE]\n\n"


async def _gather_unless_disconnected(generation: Generation, formatter: Formatter, request: Request) -> None:
    async def gather():
        async for deltas in generation.deltas():
            formatter.add(deltas)

    gathering = asyncio.ensure_future(gather())
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((gathering, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if not gathering.done():
        gathering.cancel()  # the client is gone: close() aborts the request
        raise OpenAIError(400, "the client disconnected")
    gathering.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
