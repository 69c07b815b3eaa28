"""gRPC plumbing shared by the three services: errors → status codes, health, reflection.

Servicers stay thin: they raise ``ServiceError`` (or let ``ValueError`` escape) and the one
interceptor here turns that into a status. ``x-request-id`` metadata is bound into the
structlog context for every call.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote

import grpc
import structlog
from google.protobuf import unknown_fields
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from plumbing.reflection import add_reflection
from plumbing.transport import TransportError, TransportUnavailable

REQUEST_ID_KEY = "x-request-id"
# Trailing metadata of a worker's answers: its incarnation, so a caller tells an error the
# process sent from a lost connection (no trailer) or a restarted process (another one).
INCARNATION_KEY = "splitserve-incarnation"
TRACEPARENT_KEY = "traceparent"  # W3C trace context, passed through to the workers
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:")
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's default; larger requests get RESOURCE_EXHAUSTED

log = structlog.get_logger()


class ServiceError(Exception):
    """An error with the status code the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (code, message)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TransportUnavailable):
        return grpc.StatusCode.FAILED_PRECONDITION, f"KV transport unavailable here: {exc}"
    if isinstance(exc, TransportError):
        return grpc.StatusCode.UNAVAILABLE, f"KV transport: {exc}"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def peer_host(context: grpc.aio.ServicerContext) -> str | None:
    """The IP address a call came from (``context.peer()``), or None when it is not IP."""
    peer = unquote(context.peer() or "")
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            return peer[len(prefix):].rsplit(":", 1)[0].strip("[]")
    return None


def check_request_id(value: str | None) -> str | None:
    """A client's ``x-request-id`` as given, None when absent; ValueError when it is longer
    than 128 characters or holds a character outside ``[A-Za-z0-9._:-]`` (UUIDs, Envoy's
    ids and the like pass; nothing that could forge a log field or a header does)."""
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID_CHARS.issuperset(value):
        raise ValueError(f"x-request-id must be 1-{MAX_REQUEST_ID_CHARS} characters of [A-Za-z0-9._:-]")
    return value


def metadata_value(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return str(value)
    return None


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    level = "error" if code == grpc.StatusCode.INTERNAL else "info"
    getattr(log, level)("rpc.failed", method=method, code=code.name, error=message,
                        exc_info=code == grpc.StatusCode.INTERNAL)
    await context.abort(code, message)


class Undecodable:
    """What a request deserializer hands on for bytes that are not the method's message
    (random bytes, a truncated message, invalid UTF-8, field number 0...): the handler
    wrapper rejects it with INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            message = deserializer(data)
            if any(f.field_number == 0 for f in unknown_fields.UnknownFieldSet(message)):
                return Undecodable("field number 0 is not valid")  # upb accepts it in an empty message
            return message
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever a parser raises
            return Undecodable(str(exc) or type(exc).__name__)

    return deserialize


async def _reject_undecodable(context: grpc.aio.ServicerContext, request: Undecodable, method: str) -> None:
    log.info("rpc.failed", method=method, code="INVALID_ARGUMENT", error="request does not parse")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.error}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Binds ``request_id``, maps exceptions raised by handlers to gRPC status codes, and
    rejects requests that do not parse with INVALID_ARGUMENT (every method, health and
    reflection included)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        mapped = not method.startswith(("/grpc.health", "/grpc.reflection"))
        deserialize = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method, mapped), deserialize, handler.response_serializer)
        if handler.unary_stream is not None:
            wrap = _unary_stream if inspect.isasyncgenfunction(handler.unary_stream) else _unary_writer
            return grpc.unary_stream_rpc_method_handler(
                wrap(handler.unary_stream, method, mapped), deserialize, handler.response_serializer)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                _stream_stream(handler.stream_stream, method), deserialize, handler.response_serializer)
        return handler


def _unary(inner: Callable[..., Awaitable[Any]], method: str, mapped: bool) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, request, method)
        if not mapped:
            return await inner(request, context)
        _bind(context, method)
        try:
            return await inner(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one mapping point
            await _abort(context, exc, method)

    return unary


def _unary_stream(inner: Callable[..., AsyncIterator[Any]], method: str,
                  mapped: bool) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, request, method)
        if mapped:
            _bind(context, method)
        try:
            async for item in inner(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            if not mapped:
                raise
            await _abort(context, exc, method)

    return stream


def _unary_writer(inner: Callable[..., Awaitable[None]], method: str,
                  mapped: bool) -> Callable[..., Awaitable[None]]:
    """A server-streaming handler written as a coroutine that calls ``context.write`` (the
    health service's ``Watch``): awaited, not iterated."""
    async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, request, method)
        if mapped:
            _bind(context, method)
        result = inner(request, context)
        if inspect.isasyncgen(result):  # a plain function that returns a generator
            async for item in result:
                await context.write(item)
        else:
            await result

    return writer


def _stream_stream(inner: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await _reject_undecodable(context, request, method)
                yield request

        async for item in inner(checked(), context):
            yield item

    return stream


def _bind(context: grpc.aio.ServicerContext, method: str) -> None:
    for key, field in ((REQUEST_ID_KEY, "request_id"), (TRACEPARENT_KEY, "traceparent")):
        value = metadata_value(context, key)
        if value is not None and _loggable(value):
            structlog.contextvars.bind_contextvars(**{field: value})
    structlog.contextvars.bind_contextvars(rpc=method.rsplit("/", 1)[-1])


def _loggable(value: str) -> bool:
    try:
        return check_request_id(value) is not None  # a traceparent is of the same charset
    except ValueError:
        return False


def make_server(options: Iterable[tuple[str, Any]] = (),
                interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> grpc.aio.Server:
    """A ``grpc.aio`` server with the message-size limit and ``interceptors`` (default: the
    error interceptor alone; ``plumbing/servers.py`` puts authentication before it)."""
    return grpc.aio.server(
        interceptors=interceptors if interceptors is not None else [ErrorMappingInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *options,
        ],
    )


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Register grpc.health.v1 (every service SERVING) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    add_reflection(server, [*service_names, health.SERVICE_NAME])
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *service_names]:
        await servicer.set(name, status)


def channel_options() -> list[tuple[str, Any]]:
    """Options of every RPC channel between the services. Reconnection backs off to at most 1 s
    (gRPC's default grows to 120 s), so a peer restarted on the same address is reached again
    within about a second: a worker re-registers, a gateway routes to it."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT. Later ones are ignored for the rest of the
    process's life (the drain is under way; SIGKILL still ends it): left to the event loop,
    the default action would come back when the loop closes, and a repeated signal (a process
    group signalled twice) would kill the process on its way out, after a clean drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
