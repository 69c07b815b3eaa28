"""A worker's KV events on their way to the gateway, riding its heartbeats.

The engine's ``KVEventLog`` (``engine/kv_events.py``) records what the prefix cache
published and evicted; this sends it, in the ``kv_events`` field of ``HeartbeatRequest``::

    RegisterWorker answer ──▶ configure(): how many per beat (0: none wanted), how soon
    heartbeat ──▶ attach(): up to max_per_beat changes (reset + the whole cache first)
    answered known ──▶ delivered(): the log forgets what the gateway now has
    failed ──▶ kept and re-sent; INVALID_ARGUMENT ──▶ start over with the whole cache
    between beats ──▶ wait(): the period, or kv_events_interval once the cache changed

Lossy-safe by construction (see the log): a beat that never arrived is re-sent, a late one
is ignored by its sequence number, and what still goes missing only makes routing worse.
"""

from __future__ import annotations

import asyncio

import grpc

from engine.kv_events import KVEventBatch, KVEventLog
from plumbing.convert import kv_events_to_proto
from splitserve.v1 import gateway_pb2


class KVEventSender:
    """Owned by the worker's registration client (event loop); the log is thread-safe."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.max_per_beat = 0  # until a registration answer asks for events
        self.interval_s = 0.05
        self._last_ok = False

    def configure(self, response: gateway_pb2.RegisterWorkerResponse) -> None:
        """A (new) registration: the gateway knows nothing of this cache, send all of it."""
        self.max_per_beat = response.kv_events_max_per_beat
        self.interval_s = max(response.kv_events_interval_ms, 1) / 1000.0
        self._last_ok = True  # the gateway just answered: the cache goes out at the next interval
        self.log.resync()

    def attach(self, request: gateway_pb2.HeartbeatRequest) -> KVEventBatch | None:
        """Put the next batch into ``request``; the batch, or None when none is due."""
        if not self.max_per_beat:
            return None
        batch = self.log.take(self.max_per_beat)
        if batch is not None:
            request.kv_events.CopyFrom(kv_events_to_proto(batch))
        return batch

    def delivered(self, batch: KVEventBatch | None) -> None:
        self._last_ok = True
        if batch is not None:
            self.log.ack(batch)

    def failed(self, exc: grpc.aio.AioRpcError, batch: KVEventBatch | None) -> None:
        self._last_ok = False
        if batch is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            self.log.resync()  # the gateway refused what it was sent: start from a clean slate

    async def wait(self, period_s: float) -> None:
        """Sleep until the next heartbeat is due: after ``period_s``, or sooner (every
        ``interval_s``) once the cache changed, while the gateway answers and wants events."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + period_s
        while (left := deadline - loop.time()) > 0:
            if not (self.max_per_beat and self._last_ok):
                await asyncio.sleep(left)
                return
            await asyncio.sleep(min(self.interval_s, left))
            if self.log.has_pending():
                return
