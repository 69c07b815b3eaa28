"""KV events: what the prefix cache published and evicted, for a router that wants to know
which worker holds which prefix (KV-aware routing).

The engine thread records each change as it happens (``BlockPool`` calls ``stored`` when it
publishes a block hash and ``removed`` when it evicts one). Another thread (the worker's
heartbeat) ships them in bounded batches and acknowledges what the router took::

    engine thread: stored(h) / removed(h) ──▶ pending {hash: now cached?}   (net change per hash)
    heartbeat:     take(n) ──▶ batch (seq, reset, stored, removed) ──▶ router
                   ack(batch) once the router answered; a failed beat acks nothing (re-sent)
    registration:  resync() ──▶ the next batches carry reset + every cached hash

Why it is safe to lose or repeat a batch: ``pending`` keeps, per hash, only whether it is
cached *now*, so applying a batch is idempotent and the latest value always wins; an
unacknowledged batch is taken again (with a higher ``seq``, so a late duplicate can be
told apart). ``pending`` is bounded: beyond ``max_pending`` hashes (a router that stopped
listening), it is replaced by a resync, which needs at most the cache's size. A router
that still misses an event routes worse, never wrongly: the worker's own prefix cache
decides what hits.

Thread-safe: one lock around everything; the engine thread's calls are O(1).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import islice

from engine.block_hash import BlockHash


@dataclass(frozen=True)
class KVEventBatch:
    """One batch for the router. ``reset``: forget everything this worker reported before
    applying it. ``items`` are (hash, cached now) pairs; ``stored``/``removed`` split them."""

    seq: int
    epoch: int
    reset: bool
    items: tuple[tuple[BlockHash, bool], ...]

    @property
    def stored(self) -> list[BlockHash]:
        return [h for h, cached in self.items if cached]

    @property
    def removed(self) -> list[BlockHash]:
        return [h for h, cached in self.items if not cached]


class KVEventLog:
    """The changes of one block pool's cache map. ``max_pending`` must exceed the pool's
    size (a resync puts every cached hash in ``pending``)."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._cached: dict[BlockHash, None] = {}  # mirror of the pool's cache map, publish order
        self._pending: dict[BlockHash, bool] = {}
        self._reset = True  # nothing was ever delivered: the first batch starts from scratch
        self._epoch = 0
        self._seq = 0
        self.num_overflows = 0

    # -- the engine thread -------------------------------------------------------------
    def stored(self, block_hash: BlockHash) -> None:
        """A block was published under ``block_hash``."""
        with self._lock:
            self._cached[block_hash] = None
            self._note(block_hash, True)

    def removed(self, block_hash: BlockHash) -> None:
        """The block published under ``block_hash`` was evicted."""
        with self._lock:
            self._cached.pop(block_hash, None)
            self._note(block_hash, False)

    def _note(self, block_hash: BlockHash, cached: bool) -> None:
        self._pending[block_hash] = cached
        if len(self._pending) > self.max_pending:
            self.num_overflows += 1
            self._resync_locked()

    # -- the consumer --------------------------------------------------------------------
    def has_pending(self) -> bool:
        with self._lock:
            return self._reset or bool(self._pending)

    def take(self, max_events: int) -> KVEventBatch | None:
        """Up to ``max_events`` pending changes (oldest first), or None when there is nothing
        to send. Nothing leaves ``pending`` until ``ack``."""
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        with self._lock:
            if not self._pending and not self._reset:
                return None
            self._seq += 1
            items = tuple(islice(self._pending.items(), max_events))
            return KVEventBatch(self._seq, self._epoch, self._reset, items)

    def ack(self, batch: KVEventBatch) -> None:
        """The router applied ``batch``: drop what it carried, unless a hash changed since
        (its newer value stays pending) or a resync started since (everything stays)."""
        with self._lock:
            if batch.epoch != self._epoch:
                return
            if batch.reset:
                self._reset = False
            for block_hash, cached in batch.items:
                if self._pending.get(block_hash) == cached:
                    del self._pending[block_hash]

    def resync(self) -> None:
        """Start over: the next batches carry ``reset`` and every cached hash (after a
        (re)registration, when the router knows nothing of this worker)."""
        with self._lock:
            self._resync_locked()

    def _resync_locked(self) -> None:
        self._epoch += 1
        self._reset = True
        self._pending = dict.fromkeys(self._cached, True)

    def cached_hashes(self) -> set[BlockHash]:
        """A copy of the hashes cached now (tests and checks)."""
        with self._lock:
            return set(self._cached)
