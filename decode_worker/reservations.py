"""Reservations for remote prefills: KV blocks taken for a sequence whose pages will arrive
from a prefill worker, from the request for blocks to admission or failure.

Everything here runs on the engine thread (the table is its state), except ``TransferRecord.lock``
and ``done``, which the receiver thread and the event loop use as documented::

    Decode(remote) ──request()──▶ granted now, or a waiter (FIFO) served by serve_waiters()
                                  after each engine iteration; past its wait: None
    granted ──▶ pending[transfer_id] ──pages written, admit()──▶ the engine's running batch
                     │ lease expires / stream ends / receive fails ──▶ drop(): blocks freed
                     └──── recent[transfer_id] keeps the record for AwaitTransfer (bounded)

A grant mints the transfer id and its secret (``plumbing.identity``); ``lookup`` finds a
record only for the right (id, secret) pair, and the pages' frames must carry the record's
``tag``. A request id gets at most ``max_per_request`` reservations here (its lease cannot
be renewed without end by asking again); a reservation is exactly the prompt's blocks, the
leading ones possibly this worker's own prefix-cache hits (``num_cached_blocks``), whose
pages are not shipped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from plumbing.identity import frame_tag, mint_id, mint_secret, secrets_match
from plumbing.rpc import ServiceError
from plumbing.transport import Transfer, TransferState
from splitserve.v1 import kv_transfer_pb2

log = structlog.get_logger()
MAX_RECENT = 4096  # finished records kept for AwaitTransfer (and request ids' grant counts)


@dataclass(eq=False)
class TransferRecord:
    """One remote prefill on this worker: its reservation and its transfer."""

    request_id: str
    transfer: Transfer
    secret: bytes = field(repr=False)
    block_ids: list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_deadline: float
    done: asyncio.Future[TransferState] = field(repr=False)  # settled on DONE or FAILED
    header: kv_transfer_pb2.TransferHeader | None = None
    channel_id: int = 0  # the channel the transfer was announced on
    recv_started: float = 0.0
    num_prior_draws: int = 0  # a migrated request: tokens of the prompt generated elsewhere
    num_cached_blocks: int = 0  # leading blocks that are this worker's prefix-cache hits (no pages)
    num_chunks_left: int = 0  # messages of the announced transfer not yet written (receiver thread)
    recv_failed: bool = False  # a message failed; the first failure is the one reported
    # Held while pages are written into block_ids (receiver thread) and while the blocks are
    # freed (engine thread): a lease can never free blocks that are being written.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_fresh_blocks(self) -> int:
        """The blocks whose pages travel (after the prefix-cache hits)."""
        return len(self.block_ids) - self.num_cached_blocks

    @property
    def tag(self) -> int:
        """The frame tag the pages of this transfer must arrive with."""
        return frame_tag(self.transfer.transfer_id, self.secret)


@dataclass(eq=False)
class _Waiter:
    """A Decode stream waiting for blocks to free up."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_s: float
    deadline: float
    granted: asyncio.Future[TransferRecord | None] = field(repr=False)
    num_prior_draws: int = 0


class ReservationTable:
    """The decode worker's reservations (engine-thread owned)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, push: Callable[[str, BaseException], None],
                 on_failed: Callable[[], None], max_per_request: int) -> None:
        self._loop = loop
        self._max_per_request = max_per_request
        self._num_granted: OrderedDict[str, int] = OrderedDict()  # request id -> grants (bounded)
        self._push = push  # hands an error to a request's Decode stream (any thread)
        self._on_failed = on_failed  # counts a failed transfer
        self.pending: dict[int, TransferRecord] = {}  # transfer_id -> waiting for pages
        self.recent: OrderedDict[int, TransferRecord] = OrderedDict()  # for AwaitTransfer
        self._waiters: deque[_Waiter] = deque()
        self.num_blocks = 0  # blocks in pending reservations (read by heartbeats: an int)

    # -- taking blocks ---------------------------------------------------------------------
    def request(self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
                lease_s: float, wait_s: float, num_prior_draws: int = 0) -> asyncio.Future[TransferRecord | None]:
        """Reserve blocks for ``prompt`` now, or queue behind earlier waiters until blocks
        free up; the future gets the record, or None once ``wait_s`` passed (or ValueError
        when the prompt could never be reserved here)."""
        if self._num_granted.get(rid, 0) >= self._max_per_request:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request_id {rid} already had {self._max_per_request} reservations here "
                               "(max_reservations_per_request)")
        waiter = _Waiter(rid, prompt, params, lease_s, time.monotonic() + wait_s,
                         self._loop.create_future(), num_prior_draws)
        self._waiters.append(waiter)
        self.serve_waiters(engine)
        return waiter.granted

    def serve_waiters(self, engine: Engine) -> None:
        """Grant waiters in arrival order while the pool has room; expire overdue ones.
        Runs after every engine iteration (``on_tick``): blocks free up in steps and calls."""
        now = time.monotonic()
        for waiter in [w for w in self._waiters if now >= w.deadline]:
            self._waiters.remove(waiter)
            self._settle(waiter.granted, None)
        while self._waiters:
            waiter = self._waiters[0]
            try:
                block_ids = engine.reserve_kv(waiter.request_id, len(waiter.prompt_token_ids),
                                              waiter.prompt_token_ids)
            except ValueError as exc:  # could never fit (or the id is in use): refuse this one
                self._waiters.popleft()
                self._settle(waiter.granted, exc)
                continue
            if block_ids is None:
                return  # first come, first served: later waiters do not jump the queue
            self._waiters.popleft()
            record = self._grant(waiter, list(block_ids))
            record.num_cached_blocks = engine.reserved_num_cached_blocks(waiter.request_id)
            self._settle(waiter.granted, record)

    def _grant(self, waiter: _Waiter, block_ids: list[int]) -> TransferRecord:
        record = TransferRecord(
            waiter.request_id, Transfer(mint_id()), mint_secret(), block_ids, waiter.prompt_token_ids,
            waiter.params, lease_deadline=time.monotonic() + waiter.lease_s,
            done=self._loop.create_future(), num_prior_draws=waiter.num_prior_draws,
        )
        tid = record.transfer.transfer_id
        self._num_granted[waiter.request_id] = self._num_granted.pop(waiter.request_id, 0) + 1
        while len(self._num_granted) > MAX_RECENT:
            self._num_granted.popitem(last=False)
        self.pending[tid] = record
        self.recent[tid] = record
        while len(self.recent) > MAX_RECENT:
            self.recent.popitem(last=False)
        self.num_blocks += len(block_ids)
        return record

    def lookup(self, transfer_id: int, secret: bytes, finished_too: bool = False) -> TransferRecord | None:
        """The record named by ``transfer_id`` if ``secret`` is its secret, else None (the same
        answer for an unknown id and a wrong secret). Any thread (reads one dict entry)."""
        record = (self.recent if finished_too else self.pending).get(transfer_id)
        if record is None or not secrets_match(secret, record.secret):
            return None
        return record

    # -- freeing ---------------------------------------------------------------------------
    def forget(self, engine: Engine, rid: str, reason: str) -> None:
        """Free whatever ``rid`` holds here (a wait, a reservation or a running sequence), once."""
        for waiter in [w for w in self._waiters if w.request_id == rid]:
            self._waiters.remove(waiter)
            self._settle(waiter.granted, None)
        for tid, record in list(self.pending.items()):
            if record.request_id == rid:
                self.drop(engine, tid, reason)
                return
        engine.abort(rid)

    def drop(self, engine: Engine, transfer_id: int, reason: str, error: ServiceError | None = None) -> None:
        """Fail a reservation and free its blocks (after any page write in progress ends);
        ``error`` ends the request's Decode stream."""
        record = self.pending.pop(transfer_id)
        with record.lock:
            record.transfer.fail(reason)
            engine.cancel_reservation(record.request_id)
        self.num_blocks -= len(record.block_ids)
        self.resolve(record)
        self._on_failed()
        log.info("kv.reservation_freed", request_id=record.request_id, reason=reason)
        if error is not None:
            self._push(record.request_id, error)

    def expire_leases(self, engine: Engine) -> None:
        """Free reservations whose pages did not arrive within their lease."""
        now = time.monotonic()
        for tid, record in list(self.pending.items()):
            if now >= record.lease_deadline and record.transfer.state != TransferState.DONE:
                self.drop(engine, tid, "lease expired before the KV pages arrived",
                          ServiceError(grpc.StatusCode.UNAVAILABLE, "KV pages did not arrive within the lease"))

    # -- admission -------------------------------------------------------------------------
    def admit(self, engine: Engine, record: TransferRecord, error: BaseException | None) -> None:
        """Turn a DONE transfer's reservation into a running sequence (or fail it)."""
        tid = record.transfer.transfer_id
        if self.pending.get(tid) is not record:
            return  # already freed (lease, cancel)
        if error is not None:
            self.drop(engine, tid, f"receive failed: {error}",
                      ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV receive failed: {error}"))
            return
        header = record.header
        assert header is not None
        first = header.first_logprob if header.HasField("first_logprob") else None
        try:
            engine.admit_prefilled(
                record.request_id, record.prompt_token_ids, header.first_token_id, record.params,
                first_logprob=first.logprob if first is not None else None,
                first_top_logprobs=dict(first.top_logprobs) if first is not None and record.params.logprobs else None,
                num_prior_draws=record.num_prior_draws,
            )
        except ValueError as exc:
            self.drop(engine, tid, f"admission refused: {exc}",
                      ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        del self.pending[tid]
        self.num_blocks -= len(record.block_ids)
        log.debug("kv.admitted", request_id=record.request_id, num_blocks=len(record.block_ids))

    def resolve(self, record: TransferRecord) -> None:
        """Settle ``record.done`` with its transfer's state (any thread)."""
        self._settle(record.done, record.transfer.state)

    def _settle(self, future: asyncio.Future, value: object) -> None:
        """Set ``future``'s result (an exception: its exception) on the event loop, unless
        it is done (any thread)."""
        def settle() -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
                future.exception()  # retrieved: an awaiter still gets it, nobody else logs it
            else:
                future.set_result(value)

        self._loop.call_soon_threadsafe(settle)
