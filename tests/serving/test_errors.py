"""Every error in OpenAI's shape with the right status: 400, 404, 405, 413, and 401 / 429 on a server with a key
and a queue limit (where nothing admitted is lost)."""

import asyncio
import json

import httpx
import pytest

from tests.serving.conftest import SMALL_POOL, ServerProcess

KEY = "s3cret-key"


def assert_openai_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    if param != "any":
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [3, 100000]}, "prompt"),
    ({}, "prompt"),
])  # fmt: skip
def test_invalid_parameters_are_400(server, body, param):
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 400, param)


def test_chat_errors(server):
    url = f"{server.url}/v1/chat/completions"
    assert_openai_error(httpx.post(url, json={"messages": []}, timeout=30), 400, "messages")
    assert_openai_error(httpx.post(url, json={"messages": [{"role": "robot", "content": "x"}]}, timeout=30), 400)
    bad = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_openai_error(httpx.post(url, json=bad, timeout=30), 400, "top_logprobs")


def test_prompt_longer_than_context_names_both_numbers(server):
    error = assert_openai_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": [7] * 300}, timeout=30), 400)
    assert "300" in error["message"] and "128" in error["message"]


def test_unknown_model_route_method_and_body(server):
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "model": "gpt-9"}), 404, "model")
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions"), 405)
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"}), 400)  # fmt: skip
    huge = json.dumps({"prompt": "a" * (9 * 2**20)})
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=huge,
                                   headers={"content-type": "application/json"}, timeout=30), 413)  # fmt: skip


@pytest.fixture(scope="module")
def guarded():
    """A server with an API key (from the environment) and room for two requests at once."""
    process = ServerProcess(*SMALL_POOL, "--max-queued-requests", "2", env={"RIMURU_API_KEY": KEY})
    yield process
    process.stop()


def test_api_key_guards_v1_only(guarded):
    url = f"{guarded.url}/v1/models"
    assert assert_openai_error(httpx.get(url), 401)["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.post(f"{guarded.url}/v1/completions", json={"n": "bad"}), 401)  # the key comes first
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200 and httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_overload_is_429_and_admitted_requests_complete(guarded):
    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as client:
            admitted = [await _open_stream(client, body) for _ in range(2)]  # both hold a slot until they finish
            extra = await asyncio.gather(*(client.post("/v1/completions", json=body | {"stream": False, "stream_options": None})
                                           for _ in range(4)))  # fmt: skip
            finished = [await _finish_stream(stream) for stream in admitted]
            after = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        return extra, finished, after

    extra, finished, after = asyncio.run(run())
    for response in extra:
        assert_openai_error(response, 429)
    assert finished == [100, 100]  # nothing admitted was lost
    assert after.status_code == 200  # the slots came back


async def _open_stream(client: httpx.AsyncClient, body: dict):
    stream = client.stream("POST", "/v1/completions", json=body)
    response = await stream.__aenter__()
    assert response.status_code == 200
    lines = response.aiter_lines()
    while not (await lines.__anext__()).startswith("data: "):
        pass
    return stream, response, lines


async def _finish_stream(opened) -> int:
    """Reads the rest of the stream; returns the completion tokens of its usage chunk."""
    stream, _, lines = opened
    finish, completion_tokens = None, None
    async for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            finish = chunk["choices"][0]["finish_reason"] if chunk["choices"] else finish
            completion_tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else completion_tokens
    await stream.__aexit__(None, None, None)
    assert finish == "length"
    return completion_tokens
