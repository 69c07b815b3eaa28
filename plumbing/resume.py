"""Streams that outlive their gateway: the client side of ``GenerateRequest.resume``.

A ``Generate`` stream breaks when its gateway dies (UNAVAILABLE: socket closed, connection
reset, GOAWAY, nothing listening) or ends without the chunk that carries ``finish_reason``.
The client then sends the same request again, to any gateway, with ``resume.token_ids`` =
every token it has received; the gateway continues from there and sends only what follows
(docs/architecture.md, "Streams that outlive their gateway"). ``ResumableStream`` is that
logic, once, with no I/O; ``generate_resumable`` drives it over ``grpc.aio`` (the HTTP
front), ``splitserve.client.GatewayClient`` over blocking ``grpc``.

What is retried: UNAVAILABLE, and an OK end without a final chunk. Nothing else: a request the
gateway refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) is refused again, and the caller's
own deadline or cancellation ends the stream. At most ``max_retries`` re-sends, backing off
from ``first_backoff_s`` doubling to ``max_backoff_s``, never past the caller's deadline.

Several gateways are one channel: ``gateway_target`` turns a list of IP addresses into one
gRPC target and ``LOAD_BALANCING`` spreads calls over every address (or every A/AAAA record of
a DNS name) that is up, round-robin; a dead gateway's address leaves the rotation when its
connection drops, so the re-send goes to a live one, or to the same one once it is back.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger()

LOAD_BALANCING: list[tuple[str, Any]] = [("grpc.lb_policy_name", "round_robin")]


@dataclass(frozen=True)
class ResumePolicy:
    """How hard a client tries to continue a broken stream."""

    max_retries: int = 20  # re-sends per request (resumes and failed calls), 0: none
    first_backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff must satisfy 0 < first_backoff_s <= max_backoff_s, got "
                             f"{self.first_backoff_s} and {self.max_backoff_s}")


class BrokenStream(grpc.RpcError):
    """A stream that ended OK but without its final chunk (read as UNAVAILABLE)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the gateway's stream ended without a final chunk"


def gateway_target(addresses: str | Sequence[str]) -> str:
    """One gRPC target for one address or several (a list, or comma-separated): one is used
    as given (``host:port``, ``dns:///name:port``); several must be IP ``addr:port``s of one
    family (``[v6]:port``), joined as ``ipv4:``/``ipv6:``. ValueError otherwise."""
    items = [a.strip() for a in (addresses.split(",") if isinstance(addresses, str) else addresses) if a.strip()]
    if not items:
        raise ValueError("no gateway address given")
    if len(items) == 1:
        return items[0]
    families = set()
    for item in items:
        host, _, port = item.rpartition(":")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ValueError(f"gateway address {item!r}: several addresses must be IP:port; for host names "
                             "give one DNS name that resolves to every gateway") from None
        if not port.isdigit():
            raise ValueError(f"gateway address {item!r}: no port")
    if len(families) > 1:
        raise ValueError("gateway addresses: IPv4 and IPv6 cannot be mixed in one list")
    return f"ipv{families.pop()}:" + ",".join(items)


@dataclass
class ResumableStream:
    """One request's progress across its streams (owned by the caller's task or thread):
    what the caller has received, and whether and when to send the request again."""

    request: gateway_pb2.GenerateRequest
    policy: ResumePolicy
    deadline: float | None  # time.monotonic() when the caller's time is up; None: no deadline
    delivered: list[int] = field(default_factory=list)  # every token id the caller was given
    num_resumes: int = 0  # resumed streams that sent something
    num_retries: int = 0
    finished: bool = False
    _resuming: bool = False  # the stream now open carries resume
    _chunks_now: int = 0  # chunks of the stream now open

    @classmethod
    def start(cls, request: gateway_pb2.GenerateRequest, policy: ResumePolicy,
              timeout_s: float | None) -> ResumableStream:
        return cls(request, policy, None if timeout_s is None else time.monotonic() + timeout_s)

    def next_request(self) -> gateway_pb2.GenerateRequest:
        """What to send now: the request, or it with what was received (``resume``)."""
        self._chunks_now = 0
        self._resuming = bool(self.delivered) or self.num_resumes > 0
        if not self._resuming:
            return self.request
        again = gateway_pb2.GenerateRequest()
        again.CopyFrom(self.request)
        again.resume.token_ids.extend(self.delivered)
        again.resume.num_previous_resumes = self.num_resumes
        return again

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def take(self, chunk: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateResponse:
        """Record a chunk before the caller gets it; return it."""
        if self._resuming and not self._chunks_now:
            self.num_resumes += 1
        self._chunks_now += 1
        self.delivered.extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finished = True
        return chunk

    def broke(self, error: grpc.RpcError) -> float:
        """The stream failed with ``error``: seconds to wait before sending again, or
        ``error`` raised when it must not be (not retryable, retries or time used up)."""
        if self.finished or error.code() != grpc.StatusCode.UNAVAILABLE or self.num_retries >= self.policy.max_retries:
            raise error
        delay = min(self.policy.max_backoff_s, self.policy.first_backoff_s * 2 ** self.num_retries)
        delay *= random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not a secret
        left = self.time_left()
        if left is not None and left <= delay:
            raise error
        self.num_retries += 1
        log.info("client.resuming", retry=self.num_retries, num_delivered=len(self.delivered),
                 code=error.code().name, details=error.details(), backoff_s=round(delay, 3))
        return delay


async def generate_resumable(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
                             metadata: Sequence[tuple[str, str]] = (), timeout_s: float | None = None,
                             policy: ResumePolicy = ResumePolicy()) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """``stub.Generate(request)`` (a ``grpc.aio`` stub) continued across broken streams:
    each token once, in order; the last error (a ``grpc.RpcError``) once it gives up."""
    state = ResumableStream.start(request, policy, timeout_s)
    while True:
        call = stub.Generate(state.next_request(), metadata=tuple(metadata), timeout=state.time_left())
        try:
            async for chunk in call:
                yield state.take(chunk)
            if state.finished:
                return
            error: grpc.RpcError = BrokenStream()
        except grpc.aio.AioRpcError as exc:
            if state.finished:  # the final chunk came: a cut after it (its gateway killed) loses nothing
                return
            error = exc
        finally:
            call.cancel()
        await asyncio.sleep(state.broke(error))
