"""`serve`: build the engine, wrap it in the app and run uvicorn with a draining shutdown.

SIGTERM (or Ctrl+C) stops admission (new requests get 503, `/health` turns 503), waits up to `shutdown_timeout`
seconds for the requests in flight, aborts what is left, then lets uvicorn close. A second signal exits at once.
"""

import asyncio
import logging
import os
import signal
import socket

import uvicorn

from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.models.checkpoint import TINY_MODEL_NAME, tiny_model_path
from rimuru.serving.app import create_app
from rimuru.serving.engine_loop import EngineLoop
from rimuru.serving.gateway import Gateway, ServerSettings
from rimuru.serving.metrics import Metrics
from rimuru.serving.timeline import Timeline

logger = logging.getLogger("rimuru.serving")
def leave_a_core_for_the_event_loop(device: str | None) -> None:
    """On CPU, torch's intra-op threads default to every core and spin against the event loop's thread (a tiny-model
    step was twenty times slower with two threads on two busy cores than with one); one core stays free. OMP_NUM_THREADS wins."""
    import torch

    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def build_app(model: str | None, engine_options: dict, settings: dict):
    """(app, gateway) for `model` (None: the embedded tiny model); `settings` are `ServerSettings` fields."""
    leave_a_core_for_the_event_loop(engine_options.get("device"))
    path = model or tiny_model_path()
    names = tuple(settings.pop("served_model_names", None) or (model or TINY_MODEL_NAME,))
    server_settings = ServerSettings(served_model_names=names, model_path=path, **settings)
    engine_loop = EngineLoop(lambda: Engine(EngineConfig(model=path, **engine_options)),
                             Metrics(server_settings.model_name), Timeline())  # fmt: skip
    engine_loop.start()  # load errors surface here, before the port is bound
    app = create_app(engine_loop, server_settings)
    return app, app.state.gateway


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        logger.info("draining: no new requests, up to %.1f s for %d in flight",
                    self.gateway.settings.shutdown_timeout, self.gateway.num_in_flight)  # fmt: skip
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        if not await self.gateway.drain(self.gateway.settings.shutdown_timeout):
            logger.warning("shutdown timeout: aborting %d requests", self.gateway.num_in_flight)
            self.gateway.engine_loop.abort_all()
            await asyncio.sleep(0.2)  # let the aborted streams send their last chunk
        self.should_exit = True


def check_port_free(host: str, port: int) -> None:
    """ValueError when (host, port) cannot be bound (in use, or a host this machine does not have)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot serve on {host}:{port}: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            raise ValueError(f"cannot serve on {host}:{port}: {error.strerror}") from None


def serve(model: str | None, engine_options: dict, settings: dict, host: str, port: int,
          log_level: str = "info") -> None:  # fmt: skip
    check_port_free(host, port)  # before the model loads: minutes of loading must not end in "address in use"
    app, gateway = build_app(model, engine_options, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="on")  # fmt: skip
    logger.info("serving %s on http://%s:%d (dashboard at /dashboard)", gateway.settings.model_name, host, port)
    DrainingServer(config, gateway).run()
