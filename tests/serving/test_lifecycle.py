"""Clients that go away and servers that are told to stop: a disconnect aborts the request and its pages return to
the pool; SIGTERM stops admission, turns /health to 503 and drains (or, past --shutdown-timeout, aborts)."""

import json
import re
import signal

import httpx
import pytest

from tests.serving.conftest import ServerProcess, wait_until

LONG = {"prompt": "Hi", "max_tokens": 120, "ignore_eos": True}


def aborted_count(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(r'rimuru:request_success_total\{finished_reason="abort",model_name="[^"]+"\} ([0-9.e+]+)', text)
    return float(match.group(1)) if match else 0.0


def idle_pool(server) -> dict:
    """The pool split once nothing runs or waits."""
    def sample():
        current = server.memory()["current"]
        return current if current["running"] == 0 and current["waiting"] == 0 else None

    return wait_until(sample, timeout=15)


def pool_level(current: dict) -> tuple:
    return current["expert_pages"], current["kv_pages"], current["free_pages"], current["trapped_pages"]


def test_stream_disconnect_aborts_and_frees_pages(server):
    before, aborts = idle_pool(server), aborted_count(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG | {"stream": True, "n": 4}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert wait_until(lambda: server.memory()["current"]["kv_pages"] > before["kv_pages"], timeout=10)
    # leaving the block closed the connection mid-stream
    wait_until(lambda: aborted_count(server) >= aborts + 4, timeout=10)
    assert pool_level(idle_pool(server)) == pool_level(before)


def test_non_streaming_disconnect_aborts_and_frees_pages(server):
    before, aborts = idle_pool(server), aborted_count(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG | {"n": 4}, timeout=httpx.Timeout(30, read=0.05))
    wait_until(lambda: aborted_count(server) >= aborts + 4, timeout=10)
    assert pool_level(idle_pool(server)) == pool_level(before)


def _first_chunk(response):
    """The stream's line iterator, after its first chunk."""
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: {"))
    return lines


def _rest(lines) -> tuple[set, bool]:
    """(finish reasons seen, whether the stream ended with [DONE])."""
    reasons, done = set(), False
    for line in lines:
        if line.startswith("data: {"):
            reasons |= {c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]}
        done = done or line == "data: [DONE]"
    return reasons, done


def _health(process) -> int | None:
    try:
        return httpx.get(f"{process.url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def test_sigterm_drains_in_flight_requests():
    process = ServerProcess("--device", "cpu", "--shutdown-timeout", "120")
    try:
        body = {"prompt": "Hi", "max_tokens": 400, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{process.url}/v1/completions", json=body, timeout=60) as response:
            lines = _first_chunk(response)
            process.signal(signal.SIGTERM)
            assert wait_until(lambda: _health(process) == 503, timeout=10)
            rejected = httpx.post(f"{process.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert rejected.status_code == 503 and rejected.json()["error"]["type"] == "service_unavailable"
            reasons, done = _rest(lines)
        assert reasons == {"length"} and done  # the request in flight finished normally
        assert process.process.wait(30) == 0
    finally:
        process.stop()


def test_sigterm_past_the_timeout_aborts():
    process = ServerProcess("--device", "cpu", "--shutdown-timeout", "0.3")
    try:
        body = {"prompt": "Hi", "max_tokens": 500, "n": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{process.url}/v1/completions", json=body, timeout=60) as response:
            lines = _first_chunk(response)
            process.signal(signal.SIGTERM)
            reasons, done = _rest(lines)
        assert "abort" in reasons and done
        assert process.process.wait(30) == 0
    finally:
        process.stop()
