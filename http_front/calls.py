"""The gateway calls behind one HTTP request: one ``Generate`` stream per choice, merged
into one queue of (choice index, event), and cancelled together.

Cancelling is the point of this module: when the HTTP client goes away, ``cancel`` cancels
every stream, the gateway's handler sees CANCELLED and cancels both legs, and each worker's
handler frees its blocks in its ``finally`` (docs/architecture.md, "Ownership and leases").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from http_front.errors import ApiError, from_rpc
from splitserve.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Event:
    """A chunk of choice ``index``, or the error that ended it."""

    index: int
    chunk: gateway_pb2.GenerateResponse | None = None
    error: ApiError | None = None


class Calls:
    """The streams of one HTTP request (owned by its handler task)."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, requests: tuple[gateway_pb2.GenerateRequest, ...],
                 metadata: tuple[tuple[str, str], ...], timeout_s: float) -> None:
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._calls = [stub.Generate(r, metadata=metadata, timeout=timeout_s) for r in requests]
        self._readers = [asyncio.ensure_future(self._read(i, c)) for i, c in enumerate(self._calls)]
        self._open = len(self._calls)
        self._first: list[Event] = []

    async def _read(self, index: int, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for chunk in call:
                await self._queue.put(Event(index, chunk=chunk))
        except grpc.aio.AioRpcError as exc:
            await self._queue.put(Event(index, error=from_rpc(exc.code(), exc.details() or "")))
        finally:
            await self._queue.put(None)

    async def first(self) -> ApiError | None:
        """Wait for every choice's first event (a chunk, its end or its error), so that an
        invalid request is answered with its HTTP status before a stream is committed to;
        return the first error, if any."""
        started: set[int] = set()
        while len(started) < len(self._calls) and self._open:
            event = await self._queue.get()
            if event is None:
                self._open -= 1
                continue
            self._first.append(event)
            started.add(event.index)
            if event.error is not None:
                return event.error
        return None

    async def events(self) -> AsyncIterator[Event]:
        """Every event in arrival order (those ``first`` read come first), until all ended."""
        for event in self._first:
            yield event
        self._first = []
        while self._open:
            event = await self._queue.get()
            if event is None:
                self._open -= 1
            else:
                yield event

    def cancel(self) -> None:
        """Cancel every stream (a no-op for those that ended)."""
        for call in self._calls:
            call.cancel()
        for reader in self._readers:
            reader.cancel()
