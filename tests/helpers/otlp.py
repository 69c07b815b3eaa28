"""An OTLP/gRPC trace receiver for the tests: the services export to it as they would to a
collector; the test reads the spans back."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str  # the resource's service.name
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):  # noqa: ANN001, ANN201, N802 - the generated servicer's signature
        spans = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                spans += [Span(service, s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                          for s in scope.spans]
        with self._lock:
            self._spans += spans
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, trace_id: str, wanted: set[tuple[str, str]], within_s: float = 15.0) -> list[Span]:
        """The spans of ``trace_id`` once a span of every (service, name) in ``wanted`` arrived
        (or the time ran out). The service matters: a client span and the server span it
        leads to share the RPC's name, and each process exports its batches on its own."""
        deadline = time.monotonic() + within_s
        while True:
            found = [s for s in self.spans() if s.trace_id == trace_id]
            if wanted <= {(s.service, s.name) for s in found} or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def __enter__(self) -> Receiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
