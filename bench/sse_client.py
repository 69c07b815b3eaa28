"""A minimal keep-alive HTTP/1.1 client for Server-Sent Events, on ``h11`` (uvicorn's own
HTTP parser, already installed) and asyncio streams: what the HTTP benchmark's clients use,
so that the client's own cost stays small and alike on both sides of the comparison."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import h11


class SSEConnection:
    """One connection, one request at a time (owned by one client task)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def __aenter__(self) -> SSEConnection:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    async def _send(self, *events: Any) -> None:
        assert self._writer is not None
        self._writer.write(b"".join(self._conn.send(event) or b"" for event in events))
        await self._writer.drain()

    async def _events(self) -> AsyncIterator[Any]:
        assert self._reader is not None
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                self._conn.receive_data(await self._reader.read(65536))
                continue
            yield event
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    async def post_sse(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        """POST ``body``; yield (perf_counter time, data) for each ``data:`` event until
        ``[DONE]``. A non-200 reply raises RuntimeError with its body."""
        payload = json.dumps(body).encode()
        await self._send(h11.Request(method="POST", target=path, headers=[  # one write: no Nagle wait
            ("host", f"{self.host}:{self.port}"), ("content-type", "application/json"),
            ("content-length", str(len(payload))), ("accept", "text/event-stream")]),
            h11.Data(data=payload), h11.EndOfMessage())
        status, buffer = 0, b""
        async for event in self._events():
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                buffer += bytes(event.data)
                *complete, buffer = buffer.split(b"\n\n")
                now = time.perf_counter()
                for block in complete:
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}: {block!r}")
                    data = block.removeprefix(b"data: ")
                    if data != b"[DONE]":
                        yield now, json.loads(data)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {buffer!r}")
        self._conn.start_next_cycle()
