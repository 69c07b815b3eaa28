"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP
status mapped from the gateway's gRPC status, and the proto field a gateway message names
mapped back to the OpenAI parameter the client sent.

Every answer that is not a success carries that body: the front's own refusals (4xx naming
``param``), the gateway's statuses, Starlette's 404/405, and a bug (500, logged with its
traceback by ``Guard``; nothing else answers 500 except the gateway's own INTERNAL)."""

from __future__ import annotations

import json
import re

import grpc
import structlog
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

log = structlog.get_logger()

# gRPC status -> (HTTP status, OpenAI error type).
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "request_cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),  # the model's logits were not finite
}
# gRPC's own refusal of a message past a channel's or server's size limit ("Sent message
# larger than max (X vs. Y)", "Received message larger than max ..."): RESOURCE_EXHAUSTED,
# but a 429 would be retried forever by OpenAI clients; it is the request's size, a 413.
_TOO_LARGE = re.compile(r"message larger than max", re.IGNORECASE)

# A proto field path in a gateway message -> the OpenAI parameter it came from (longest first).
_PARAMS: tuple[tuple[str, str], ...] = (
    ("stopping.max_new_tokens", "max_tokens"),
    ("stopping.stop_strings", "stop"),
    ("stopping.min_new_tokens", "min_tokens"),
    ("sampling.temperature", "temperature"),
    ("sampling.top_p", "top_p"),
    ("sampling.seed", "seed"),
    ("sampling.logprobs", "logprobs"),
    ("prompt.chat", "messages"),
    ("prompt.text", "prompt"),
    ("prompt.token_ids", "prompt"),
    ("max_model_len", "max_tokens"),
    ("constraint", "response_format"),  # or guided_* / tools: the one constraint the request set
)


class ApiError(Exception):
    """An error the client sees as an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorResponse(JSONResponse):
    """An ``ApiError`` as a response. ASCII JSON: a message may quote what the client sent,
    and a lone surrogate there must not turn the refusal into an encoding error."""

    def __init__(self, error: ApiError, headers: dict[str, str] | None = None) -> None:
        super().__init__(error.body(), status_code=error.status, headers=headers)

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_field(param: str, message: str) -> ApiError:
    """400 naming the request field ``param``."""
    return ApiError(400, f"{param}: {message}", "invalid_request_error", param, "invalid_value")


def too_large(limit: int, what: str = "the request body") -> ApiError:
    """413: ``what`` is past ``limit`` bytes (``--max-body-bytes``)."""
    return ApiError(413, f"{what} is larger than this server accepts ({limit} bytes, --max-body-bytes)",
                    "invalid_request_error", "body", "request_too_large")


def param_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the client's parameter: ``("messages", 0, "content")`` ->
    ``messages[0].content``. Union tags (``"<text>"``, see ``schema.py``) are not fields."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith("<"):
            path += f".{part}" if path else part
    return path or "body"


def from_validation(exc: ValidationError) -> ApiError:
    """The first thing wrong with a body, as a 400 naming its field."""
    error = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    return bad_field(param_path(tuple(error["loc"])), error["msg"])


def param_of(message: str) -> str | None:
    """The OpenAI parameter a gateway message names, if any (``stopping.max_new_tokens`` ->
    ``max_tokens``)."""
    for field, param in _PARAMS:
        if re.search(rf"(?<![\w.]){re.escape(field)}\b", message):
            return param
    return None


def from_rpc(code: grpc.StatusCode, details: str) -> ApiError:
    """The gateway's status as the client's error."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE.search(details):
        return ApiError(413, f"the request is larger than the gateway accepts ({details})",
                        "invalid_request_error", "body", "request_too_large")
    status, type_ = _HTTP.get(code, (500, "server_error"))
    if status == 500:
        log.error("http.gateway_error", code=code.name, details=details)
    return ApiError(status, details or code.name, type_, param_of(details) if status == 400 else None,
                    code.name.lower())


_STARLETTE = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route: 404, wrong method: 405) as OpenAI bodies."""
    status = getattr(exc, "status_code", 400)
    type_, code = _STARLETTE.get(status, ("invalid_request_error", None))
    message = f"{request.method} {request.url.path}: {getattr(exc, 'detail', '') or 'refused'}"
    return ErrorResponse(ApiError(status, message, type_, None, code), headers=getattr(exc, "headers", None))


async def server_error(request: Request, exc: Exception) -> Response:
    """A bug's answer (``Guard`` logs it)."""
    return ErrorResponse(ApiError(500, "internal error (a bug; logged)", "server_error", None, "internal_error"))


class Guard:
    """The outermost ASGI layer: an exception that escaped the app is a bug. It is logged
    once, with its traceback (``http.bug``); the client has its 500 from ``server_error``
    (Starlette's error middleware sends it before re-raising), or, if the response had
    started, a closed connection. Nothing propagates to uvicorn."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("http.bug", path=scope.get("path"), method=scope.get("method"))
