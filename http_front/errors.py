"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP
status mapped from the gateway's gRPC status, and the proto field a gateway message names
mapped back to the OpenAI parameter the client sent."""

from __future__ import annotations

import re

import grpc

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
}

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


def bad_field(param: str, message: str) -> ApiError:
    """400 naming the request field ``param``."""
    return ApiError(400, f"{param}: {message}", "invalid_request_error", param, "invalid_value")


def param_of(message: str) -> str | None:
    """The OpenAI parameter a gateway message names, if any (``stopping.max_new_tokens`` ->
    ``max_tokens``)."""
    for field, param in _PARAMS:
        if re.search(rf"(?<![\w.]){re.escape(field)}\b", message):
            return param
    return None


def from_rpc(code: grpc.StatusCode, details: str) -> ApiError:
    """The gateway's status as the client's error."""
    status, type_ = _HTTP.get(code, (500, "server_error"))
    return ApiError(status, details or code.name, type_, param_of(details) if status == 400 else None,
                    code.name.lower())
