"""Every error the server sends, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`OpenAIError` is what handlers raise; `EXCEPTION_HANDLERS` turns it, Litestar's own exceptions (validation, 404
routes, 405, 413 bodies, 401 guards) and anything unexpected into that shape with the right status code.
"""

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

logger = logging.getLogger("rimuru.serving")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}  # fmt: skip
_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                    "stop_token_ids", "logprobs", "top_logprobs", "prompt", "messages", "model"}  # fmt: skip


class OpenAIError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code

    @classmethod
    def bad_request(cls, error: ValueError) -> "OpenAIError":
        """A 400 from the engine's or SamplingParams' ValueError, whose text starts with the field it names."""
        message = str(error)
        first = message.split(" ", 1)[0].rstrip(":")
        param = first if first in _SAMPLING_FIELDS else "prompt" if "prompt" in message else None
        return cls(400, message, param)


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    error_type = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return Response(body, status_code=status_code, media_type="application/json")


def _openai_error(_: Request, error: OpenAIError) -> Response:
    return error_response(error.status_code, error.message, error.param, error.code)


def _validation_error(_: Request, error: ValidationException) -> Response:
    """msgspec's complaint names the path (`$.n`); the first one becomes the message and the param."""
    extra = error.extra if isinstance(error.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    message = first.get("message") or error.detail
    key = first.get("key")
    param = _param_from_message(message) or (key if key not in (None, "data", "body") else None)
    return error_response(400, f"{error.detail}: {message}" if message != error.detail else message, param)


def _param_from_message(message: str) -> str | None:
    """The top-level field msgspec names: "... - at `$.n`" or "Object missing required field `prompt`"."""
    if "`$." in message:
        return message.rsplit("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    if "field `" in message and "`$" not in message:
        return message.split("field `", 1)[1].split("`", 1)[0] or None
    return None


def _http_error(_: Request, error: HTTPException) -> Response:
    code = "invalid_api_key" if error.status_code == 401 else None
    return error_response(error.status_code, str(error.detail), code=code)


def _unexpected_error(request: Request, error: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}")


EXCEPTION_HANDLERS = {
    OpenAIError: _openai_error,
    ValidationException: _validation_error,
    HTTPException: _http_error,
    Exception: _unexpected_error,
}
