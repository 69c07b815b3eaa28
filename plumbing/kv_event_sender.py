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

from engine.block_hash import BlockHash
from engine.kv_events import KVEventBatch, KVEventLog
from plumbing.convert import kv_events_to_proto
from splitserve_api.v1 import gateway_pb2


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


class KVEventTee(KVEventLog):
    """The engine's log, split per gateway: every change the pool records is copied into one
    ``KVEventLog`` per gateway (``branch``), each delivered, acknowledged and resynced on its
    own, so one gateway's lost beats or new registration never hold back another's.

    It replaces the pool's log before the engine thread starts (``install``); the engine
    calls ``stored``/``removed`` on it as before. Its own pending set is not used: only the
    branches are read. Lock order: this log's lock, then a branch's."""

    def __init__(self, max_pending: int) -> None:
        super().__init__(max_pending)
        self._branches: tuple[KVEventLog, ...] = ()

    @classmethod
    def install(cls, pool: object) -> KVEventTee:
        """Put a tee in place of ``pool.events`` (a ``BlockPool`` whose cache is still empty)."""
        old: KVEventLog = pool.events  # type: ignore[attr-defined]
        if old.cached_hashes():
            raise RuntimeError("KVEventTee.install: the pool already cached blocks")
        tee = cls(old.max_pending)
        pool.events = tee  # type: ignore[attr-defined]
        return tee

    def _note(self, block_hash: BlockHash, cached: bool) -> None:  # under self._lock
        for branch in self._branches:
            if cached:
                branch.stored(block_hash)
            else:
                branch.removed(block_hash)

    def branch(self) -> KVEventLog:
        """A new gateway's log: the whole cache as it is now, then every change."""
        branch = KVEventLog(self.max_pending)
        with self._lock:
            for block_hash in self._cached:
                branch.stored(block_hash)
            self._branches = (*self._branches, branch)
        return branch

    def prune(self, branch: KVEventLog) -> None:
        """A gateway left: stop copying changes into its log."""
        with self._lock:
            self._branches = tuple(b for b in self._branches if b is not branch)

    @property
    def num_branches(self) -> int:
        return len(self._branches)
