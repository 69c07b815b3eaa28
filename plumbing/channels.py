"""Client channels between the services: TLS or plaintext, the shared secret, rotation.

Every internal call (gateway → worker, worker → gateway registry, prefill → decode) goes
through a ``PeerChannel``. It dials with the process's ``ChannelSecurity``: the current TLS
material (``plumbing/tls.py``; the process's certificate is presented, so mTLS holds when
the peer requires it) and, when one is configured, the internal shared secret as
``authorization: Bearer`` metadata on every call.

Certificate rotation never drops a stream: after a reload the next call builds a new channel
with the new material; the old one keeps its calls (an in-flight counter kept by its
interceptors) and is closed when its last call has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from plumbing import tracing
from plumbing.auth import TokenSet, bearer_metadata
from plumbing.rpc import channel_options
from plumbing.tls import TlsStore

log = structlog.get_logger()


class ChannelSecurity:
    """How this process dials internal peers."""

    def __init__(self, tls: TlsStore | None = None, secret: TokenSet | None = None) -> None:
        self.tls = tls
        self.secret = secret if secret is not None and secret.configured else None

    @property
    def generation(self) -> int:
        return self.tls.generation if self.tls is not None else 0

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.secret.first() if self.secret is not None else None)

    def dial(self, address: str, interceptors: list[Any] | None = None) -> grpc.aio.Channel:
        """A channel to ``address``; its calls are traced when tracing is on (``plumbing/tracing.py``)."""
        options = channel_options()
        interceptors = [*(interceptors or []), *tracing.client_interceptors()]
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(),
                                       options=[*options, *self.tls.channel_options()], interceptors=interceptors)


class _Calls:
    """Counts a channel's calls in flight and adds the security metadata to each."""

    def __init__(self, metadata: Callable[[], tuple[tuple[str, str], ...]]) -> None:
        self.in_flight = 0
        self.on_idle: Callable[[], None] | None = None
        self._metadata = metadata

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        extra = self._metadata()
        if not extra:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)

    def started(self, call: Any) -> Any:
        self.in_flight += 1
        call.add_done_callback(self._ended)
        return call

    def _ended(self, _call: Any) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.on_idle is not None:
            self.on_idle()


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, calls: _Calls) -> None:
        self._calls = calls

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._calls.started(await continuation(self._calls.details(details), request))


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, calls: _Calls) -> None:
        self._calls = calls

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._calls.started(await continuation(self._calls.details(details), request))


class ChannelClosed(Exception):
    """A stub was asked of a closed ``PeerChannel``. grpc's own channel must not be asked:
    building a stub on a closed ``grpc.aio`` channel crashed the whole process (a
    segfault or an abort inside grpcio, seen with grpcio 1.85.3)."""


class PeerChannel:
    """A channel to one internal peer that follows certificate rotation (event-loop owned)."""

    def __init__(self, address: str, security: ChannelSecurity) -> None:
        self.address = address
        self._security = security
        self._generation = security.generation
        self._calls = _Calls(security.metadata)
        self._channel = security.dial(address, [_UnaryUnary(self._calls), _UnaryStream(self._calls)])
        self._stubs: dict[type, Any] = {}
        self._retired: list[tuple[grpc.aio.Channel, _Calls]] = []
        self.closed = False

    def stub(self, stub_type: type) -> Any:
        """``stub_type`` on the channel for the current credentials; ``ChannelClosed`` once closed."""
        if self.closed:
            raise ChannelClosed(f"the channel to {self.address} is closed")
        if self._security.generation != self._generation:
            self._rotate()
        stub = self._stubs.get(stub_type)
        if stub is None:
            stub = self._stubs[stub_type] = stub_type(self._channel)
        return stub

    def _rotate(self) -> None:
        old, old_calls = self._channel, self._calls
        self._generation = self._security.generation
        self._calls = _Calls(self._security.metadata)
        self._channel = self._security.dial(self.address, [_UnaryUnary(self._calls), _UnaryStream(self._calls)])
        self._stubs = {}
        log.info("channel.rotated", peer=self.address, calls_on_old=old_calls.in_flight)
        if old_calls.in_flight == 0:
            self._close_later(old)
            return
        entry = (old, old_calls)
        self._retired.append(entry)

        def idle() -> None:
            if entry in self._retired:
                self._retired.remove(entry)
                self._close_later(old)

        old_calls.on_idle = idle

    @staticmethod
    def _close_later(channel: grpc.aio.Channel) -> None:
        asyncio.get_running_loop().create_task(channel.close())

    @property
    def in_flight(self) -> int:
        return self._calls.in_flight + sum(calls.in_flight for _, calls in self._retired)

    async def close(self) -> None:
        """Close every channel now (calls still running are cancelled)."""
        self.closed = True
        for channel, _ in self._retired:
            await channel.close()
        self._retired = []
        await self._channel.close()
