"""Real `rimuru serve` processes on loopback ports with the embedded tiny model, shared per session where possible.

Every server here runs the tiny model on CPU with a small pool (`--gpu-memory-budget` caps the pool on CPU too), so
the KV share of the pool is visible and the tests stay fast. Nothing listens beyond 127.0.0.1.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

SMALL_POOL = ["--max-model-len", "128", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
              "--gpu-memory-budget", "8MiB", "--device", "cpu"]  # fmt: skip
START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "rimuru.serving.cli", "serve", "--port", str(self.port),
                   "--log-level", "warning", *args]  # fmt: skip
        self.log = open(os.devnull, "w") if not os.environ.get("RIMURU_TEST_SERVER_LOG") else None
        environ = os.environ | {"RIMURU_API_KEY": ""} | (env or {})
        self.process = subprocess.Popen(command, stdout=self.log, stderr=self.log, env=environ)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rimuru serve exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError("rimuru serve did not become healthy")

    def memory(self) -> dict:
        return httpx.get(f"{self.url}/v1/memory", timeout=5).json()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.log is not None:
            self.log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def server():
    """The shared server: tiny model, small pool, no key, no queue limit."""
    process = ServerProcess(*SMALL_POOL)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rimuru.serving.server import tiny_model_path

    return tiny_model_path()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; returns it, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"condition not met within {timeout} s"
            return value
        time.sleep(interval)
