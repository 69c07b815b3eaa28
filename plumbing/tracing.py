"""OpenTelemetry tracing, on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the standard
variable, read once at a service's start, never at import).

The OpenTelemetry SDK and its gRPC instrumentation do the work: a server span per traced
RPC, a client span per call a service makes, the W3C ``traceparent`` carried in gRPC
metadata, so one request's spans form one trace across the HTTP front, the gateway and both
workers (gateway ``Generate`` → ``Prefill`` → ``AnnounceTransfer`` / ``kv.transfer.wire`` →
``Decode``). Heartbeats, registrations, health checks and reflection are not traced: they
are periodic plumbing, and every heartbeat would be a trace of its own. Spans leave through
the OTLP/gRPC exporter in batches (``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` variables
apply, as the SDK reads them).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc

_UNTRACED_METHODS = ("Heartbeat", "RegisterWorker")
_UNTRACED_SERVICES = ("grpc.health.", "grpc.reflection.")


class _State:
    provider: Any = None  # the SDK's TracerProvider once configured; None: tracing off


def configure_tracing(service: str, environ: dict[str, str] | None = None) -> bool:
    """Set up the SDK for ``service`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces
    one) is set; True when tracing is on. Call once, at the service's start."""
    env = os.environ if environ is None else environ
    if not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = env.get("OTEL_SERVICE_NAME") or f"splitserve-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _State.provider = provider
    return True


def enabled() -> bool:
    return _State.provider is not None


def shutdown() -> None:
    """Flush and stop the exporter (at the end of the drain)."""
    if _State.provider is not None:
        _State.provider.shutdown()


def _traced(details: Any) -> bool:
    """Whether a call (server ``HandlerCallDetails`` or client ``ClientCallDetails``) gets a span."""
    method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
    service, _, name = method.lstrip("/").rpartition("/")
    return name not in _UNTRACED_METHODS and not service.startswith(_UNTRACED_SERVICES)


def server_interceptors() -> list[Any]:
    """The server span interceptor (none while tracing is off)."""
    if _State.provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_State.provider, filter_=_traced)]


def client_interceptors() -> list[Any]:
    """The client span interceptors, which also inject ``traceparent`` (none while off).

    Unary calls use the instrumentation's interceptor. Server-streaming calls use
    ``_StreamSpans``: the instrumentation's wraps the stream in an iterator whose span ends only
    when the stream is read to its end, and the services read streams with ``read()`` and
    stop at the finish message (the span would end whenever the iterator is collected)."""
    if _State.provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    unary = [i for i in aio_client_interceptors(tracer_provider=_State.provider, filter_=_traced)
             if isinstance(i, grpc.aio.UnaryUnaryClientInterceptor)]
    return [*unary, _StreamSpans(_State.provider.get_tracer("splitserve.grpc"))]


class _StreamSpans(grpc.aio.UnaryStreamClientInterceptor):
    """A CLIENT span per server-streaming call, its context sent as ``traceparent``, ended
    when the call is done (finished, failed or cancelled) with its status code."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        if not _traced(details):
            return await continuation(details, request)
        from opentelemetry import propagate, trace

        method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
        service, _, name = method.lstrip("/").rpartition("/")
        span = self._tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes={
            "rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        propagate.inject(metadata, context=trace.set_span_in_context(span))
        try:
            call = await continuation(grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                                 details.credentials, details.wait_for_ready),
                                      request)
        except BaseException:
            span.end()
            raise
        call.add_done_callback(lambda done: asyncio.ensure_future(_end(span, done)))
        return call


async def _end(span: Any, call: Any) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = await call.code()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def http_span(name: str, headers: Any) -> Any:
    """A server span for an HTTP request whose ``traceparent`` header (if any) is honoured;
    a context manager (a no-op one while tracing is off)."""
    from contextlib import nullcontext

    if _State.provider is None:
        return nullcontext()
    from opentelemetry import propagate, trace

    tracer = _State.provider.get_tracer("splitserve.http")
    return tracer.start_as_current_span(name, context=propagate.extract(dict(headers)),
                                        kind=trace.SpanKind.SERVER)


def internal_span(name: str, attributes: dict[str, Any]) -> Any:
    """A span for work inside a service (the KV pages on the wire), a child of the current
    one; a context manager (a no-op one while tracing is off)."""
    from contextlib import nullcontext

    if _State.provider is None:
        return nullcontext()
    from opentelemetry import trace

    return _State.provider.get_tracer("splitserve.kv").start_as_current_span(
        name, kind=trace.SpanKind.INTERNAL, attributes=attributes)
