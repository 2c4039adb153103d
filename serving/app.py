"""`create_app`: the Litestar application around one running `EngineLoop`.

Routes: `/v1/*` (OpenAI-compatible, behind the API key when one is set), `/health`, `/version`, `/metrics`,
`/dashboard` (a page served from the package, no CDN) and the OpenAPI document at `/openapi.json`. The app's
lifespan starts and stops the engine thread; it does not build the engine (the command line does).
"""

import hmac
from contextlib import asynccontextmanager
from importlib import resources

from litestar import Litestar, Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, NotFoundException
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from prometheus_client import CONTENT_TYPE_LATEST

import rimuru
from rimuru.serving.engine_loop import EngineLoop
from rimuru.serving.errors import EXCEPTION_HANDLERS
from rimuru.serving.gateway import Gateway, ServerSettings
from rimuru.serving.openai_api import create_chat_completion, create_completion

DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """401 unless `Authorization: Bearer <key>` matches; compared in constant time."""
    key = connection.app.state.gateway.settings.api_key
    if key is None:
        return
    header = connection.headers.get("authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise NotAuthorizedException("Incorrect or missing API key: send `Authorization: Bearer <key>`.")


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@get("/models", summary="List the served model")
async def list_models(request: Request) -> dict:
    gateway = _gateway(request)
    created, max_model_len = request.app.state.started, gateway.engine_loop.max_model_len
    card = {"object": "model", "created": created, "owned_by": "rimuru", "root": gateway.settings.model_path,
            "parent": None, "max_model_len": max_model_len}  # fmt: skip
    cards = [{"id": name, **card} for name in gateway.settings.served_model_names]
    return {"object": "list", "data": cards}


@get("/memory", summary="The page pool's split over time (the dashboard's data)")
async def memory(request: Request) -> dict:
    gateway = _gateway(request)
    snapshot = gateway.engine_loop.timeline.snapshot()
    return snapshot | {"pool_bytes": gateway.engine_loop.pool_bytes, "model": gateway.settings.model_name}


@get("/health", summary="200 while serving, 503 while draining or when the engine thread has stopped")
async def health(request: Request) -> Response:
    gateway = _gateway(request)
    if gateway.is_draining or not gateway.engine_loop.is_alive:
        return Response({"status": "draining" if gateway.is_draining else "engine stopped"}, status_code=503)
    return Response({"status": "ok"}, status_code=200)


@get("/version", summary="The Rimuru version")
async def version() -> dict:
    return {"version": rimuru.__version__ if hasattr(rimuru, "__version__") else _package_version()}


# Litestar appends the charset to text/* itself: Prometheus' type without its own charset, or the header has two
METRICS_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")


@get("/metrics", summary="Prometheus metrics", media_type=METRICS_TYPE)
async def metrics(request: Request) -> Response:
    body = request.app.state.metrics.render()
    return Response(body, media_type=METRICS_TYPE, status_code=200)


@get("/dashboard", summary="Live memory dashboard", media_type="text/html")
async def dashboard() -> Response:
    return Response(_asset("dashboard.html"), media_type="text/html", status_code=200)


@get("/dashboard/{name:str}", summary="Dashboard assets", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in DASHBOARD_FILES:
        raise NotFoundException(f"no dashboard asset {name!r}")
    return Response(_asset(name), media_type=DASHBOARD_FILES[name], status_code=200)


def _asset(name: str) -> bytes:
    return resources.files("rimuru.serving").joinpath("assets", "dashboard", name).read_bytes()


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("rimuru")
    except PackageNotFoundError:
        return "unknown"


def create_app(engine_loop: EngineLoop, settings: ServerSettings) -> Litestar:
    """The app; its lifespan starts the engine thread (if not yet running) and stops it."""
    import time

    @asynccontextmanager
    async def lifespan(app: Litestar):
        engine_loop.start()  # a no-op when the command line started it already
        try:
            yield
        finally:
            engine_loop.abort_all()
            engine_loop.stop()

    v1 = Router("/v1", route_handlers=[create_completion, create_chat_completion, list_models, memory],
                guards=[api_key_guard])  # fmt: skip
    app = Litestar(
        route_handlers=[v1, health, version, metrics, dashboard, dashboard_asset],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="Rimuru", version=_package_version(), path="/",
            render_plugins=[JsonRenderPlugin(path="/openapi.json")],
        ),  # fmt: skip
        logging_config=None,  # the command line configures logging; Litestar's default would override its level
        debug=False,
    )
    app.state.gateway = Gateway(engine_loop, settings)
    app.state.metrics = engine_loop.metrics
    app.state.started = int(time.time())
    return app
