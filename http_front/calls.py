"""The gateway calls behind one HTTP request: one ``Generate`` stream per choice, merged
into one queue of (choice index, event), and cancelled together.

A stream whose gateway dies goes on through another gateway of the channel (or the same one
once it is back), from the tokens the front already received: ``plumbing/resume.py``, the
same logic as ``splitserve.client``'s, so each token reaches the HTTP client once.

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
from plumbing.resume import ResumePolicy, generate_resumable
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Event:
    """A chunk of choice ``index``, or the error that ended it."""

    index: int
    chunk: gateway_pb2.GenerateResponse | None = None
    error: ApiError | None = None


class Calls:
    """The streams of one HTTP request (owned by its handler task)."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, requests: tuple[gateway_pb2.GenerateRequest, ...],
                 metadata: tuple[tuple[str, str], ...], timeout_s: float,
                 resume: ResumePolicy = ResumePolicy()) -> None:
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._streams = [generate_resumable(stub, r, metadata, timeout_s, resume) for r in requests]
        self._readers = [asyncio.ensure_future(self._read(i, s)) for i, s in enumerate(self._streams)]
        self._open = len(self._streams)
        self._first: list[Event] = []

    async def _read(self, index: int, stream: AsyncIterator[gateway_pb2.GenerateResponse]) -> None:
        try:
            async for chunk in stream:
                await self._queue.put(Event(index, chunk=chunk))
        except grpc.RpcError as exc:
            await self._queue.put(Event(index, error=from_rpc(exc.code(), exc.details() or "")))
        finally:
            await self._queue.put(None)

    async def first(self) -> ApiError | None:
        """Wait for every choice's first event (a chunk, its end or its error), so that an
        invalid request is answered with its HTTP status before a stream is committed to;
        return the first error, if any."""
        started: set[int] = set()
        while len(started) < len(self._streams) and self._open:
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
        """Cancel every stream (a no-op for those that ended): a reader's cancellation reaches
        its stream's open call, which ``generate_resumable`` cancels on its way out."""
        for reader in self._readers:
            reader.cancel()
