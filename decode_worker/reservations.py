"""The decode worker's reservations: blocks taken for prompts whose pages (or whose local
prefill) need room in the KV pool, from the wait for blocks to admission or failure.

Everything here runs on the engine thread (the table is its state); a ``Reservation``'s own
phase changes only through its methods, under its lock (``reservation.py``)::

    Decode ──request()/request_local()──▶ granted now, or a waiter (FIFO) served by
                                          serve_waiters() after each engine iteration;
                                          past its wait: None (RESOURCE_EXHAUSTED)
    remote: granted ──▶ pending[transfer_id] ──RECEIVED, admit()──▶ the engine's running batch
            (the engine: a request WAITING_FOR_REMOTE_KVS ──admit_prefilled──▶ WAITING ──▶ RUNNING)
                             │ lease expires / stream ends / receive fails ──▶ release(): blocks freed
    local:  granted ──▶ the blocks go back and the engine queues the prompt, in the same call

A grant mints the transfer id and its secret (``plumbing.identity``); ``lookup`` finds a
reservation only for the right (id, secret) pair, and the pages' frames must carry its
``tag``. A request id gets at most ``max_per_request`` reservations here (its lease cannot
be renewed without end by asking again); a reservation is exactly the prompt's blocks, the
leading ones possibly this worker's own prefix-cache hits (``num_cached_blocks``), whose
pages are not shipped. Nothing is kept once a reservation ends (no prompt, no record).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from decode_worker.reservation import Phase, Reservation
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from plumbing.identity import mint_id, mint_secret, secrets_match
from plumbing.rpc import ServiceError

log = structlog.get_logger()
MAX_COUNTED_IDS = 4096  # request ids whose grant counts are remembered (ids only)
Grant = Callable[[Engine, "_Waiter", list[int]], Any]  # what a waiter's granted future gets


@dataclass(eq=False)
class _Waiter:
    """A Decode stream waiting for blocks to free up."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_s: float
    deadline: float
    granted: asyncio.Future[Any] = field(repr=False)
    grant: Grant = field(repr=False)
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
        self.pending: dict[int, Reservation] = {}  # transfer_id -> live reservation (blocks held)
        self._waiters: deque[_Waiter] = deque()

    # -- taking blocks ---------------------------------------------------------------------
    def request(self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
                lease_s: float, wait_s: float, num_prior_draws: int = 0) -> asyncio.Future[Reservation | None]:
        """Reserve blocks for ``prompt`` now, or queue behind earlier waiters until blocks
        free up; the future gets the reservation, or None once ``wait_s`` passed (or
        ValueError when the prompt could never be reserved here)."""
        if self._num_granted.get(rid, 0) >= self._max_per_request:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request_id {rid} already had {self._max_per_request} reservations here "
                               "(max_reservations_per_request)")
        return self._wait(engine, _Waiter(rid, prompt, params, lease_s, time.monotonic() + wait_s,
                                          self._loop.create_future(), self._grant, num_prior_draws))

    def request_local(self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
                      wait_s: float, num_prior_draws: int = 0) -> asyncio.Future[bool | None]:
        """A local prefill waits for room like a remote one, in the same queue: once the
        prompt's blocks are free, the engine queues it (the future gets True); None once
        ``wait_s`` passed; ValueError when it could never run here."""
        return self._wait(engine, _Waiter(rid, prompt, params, 0.0, time.monotonic() + wait_s,
                                          self._loop.create_future(), _start_local, num_prior_draws))

    def _wait(self, engine: Engine, waiter: _Waiter) -> asyncio.Future[Any]:
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
                block_ids = engine.handoff.reserve_kv(waiter.request_id, len(waiter.prompt_token_ids),
                                              waiter.prompt_token_ids)
                if block_ids is None:
                    return  # first come, first served: later waiters do not jump the queue
                self._waiters.popleft()
                self._settle(waiter.granted, waiter.grant(engine, waiter, list(block_ids)))
            except ValueError as exc:  # could never fit (or the id is in use): refuse this one
                if self._waiters and self._waiters[0] is waiter:
                    self._waiters.popleft()
                self._settle(waiter.granted, exc)

    def _grant(self, engine: Engine, waiter: _Waiter, block_ids: list[int]) -> Reservation:
        reservation = Reservation(
            waiter.request_id, mint_id(), mint_secret(), block_ids, waiter.prompt_token_ids, waiter.params,
            lease_deadline=time.monotonic() + waiter.lease_s, num_prior_draws=waiter.num_prior_draws,
            num_cached_blocks=engine.handoff.reserved_num_cached_blocks(waiter.request_id),
        )
        self._num_granted[waiter.request_id] = self._num_granted.pop(waiter.request_id, 0) + 1
        while len(self._num_granted) > MAX_COUNTED_IDS:
            self._num_granted.popitem(last=False)
        self.pending[reservation.transfer_id] = reservation
        return reservation

    def lookup(self, transfer_id: int, secret: bytes) -> Reservation | None:
        """The live reservation named by ``transfer_id`` if ``secret`` is its secret, else
        None (the same answer for an unknown id and a wrong secret). Any thread (reads one
        dict entry)."""
        reservation = self.pending.get(transfer_id)
        if reservation is None or not secrets_match(secret, reservation.secret):
            return None
        return reservation

    # -- freeing ---------------------------------------------------------------------------
    def forget(self, engine: Engine, rid: str, reason: str) -> None:
        """Free whatever ``rid`` holds here (a wait, a reservation or a running sequence), once."""
        for waiter in [w for w in self._waiters if w.request_id == rid]:
            self._waiters.remove(waiter)
            self._settle(waiter.granted, None)
        for reservation in list(self.pending.values()):
            if reservation.request_id == rid:
                self.release(engine, reservation, reason)
                return
        engine.abort(rid)

    def release(self, engine: Engine, reservation: Reservation, reason: str,
                error: ServiceError | None = None) -> None:
        """Fail a live reservation and free its blocks (after any page write in progress
        ends), once; ``error`` ends the request's Decode stream."""
        if self.pending.pop(reservation.transfer_id, None) is not reservation:
            return
        reservation.release(reason, lambda: engine.handoff.free_reserved_kv(reservation.request_id))
        self._on_failed()
        log.info("kv.reservation_freed", request_id=reservation.request_id, reason=reservation.error)
        if error is not None:
            self._push(reservation.request_id, error)

    def expire_leases(self, engine: Engine) -> int:
        """Free reservations whose pages did not arrive within their lease; how many."""
        now = time.monotonic()
        expired = [r for r in list(self.pending.values()) if r.expire(now)]
        for reservation in expired:
            self.release(engine, reservation, "lease expired",
                         ServiceError(grpc.StatusCode.UNAVAILABLE, "KV pages did not arrive within the lease"))
        return len(expired)

    # -- admission -------------------------------------------------------------------------
    def admit(self, engine: Engine, reservation: Reservation) -> None:
        """A RECEIVED reservation becomes a running sequence; a FAILED one (its receive
        failed) is freed. Engine thread, queued by the receiver thread."""
        if self.pending.get(reservation.transfer_id) is not reservation:
            return  # already freed (lease, cancel)
        if reservation.phase is Phase.FAILED:
            self.release(engine, reservation, "receive failed", ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"KV receive failed: {reservation.error}"))
            return
        try:
            reservation.admit(lambda: _admit_prefilled(engine, reservation))
        except ValueError as exc:
            self.release(engine, reservation, f"admission refused: {exc}",
                         ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        del self.pending[reservation.transfer_id]
        log.debug("kv.admitted", request_id=reservation.request_id, num_blocks=len(reservation.block_ids))

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


def _start_local(engine: Engine, waiter: _Waiter, block_ids: list[int]) -> bool:
    """A local prefill's room was found: hand the blocks back and queue the prompt in the same
    engine-thread call, so nothing else can take them first."""
    engine.handoff.free_reserved_kv(waiter.request_id)
    engine.add_request(waiter.prompt_token_ids, waiter.params, request_id=waiter.request_id,
                       num_prior_draws=waiter.num_prior_draws)
    return True


def _admit_prefilled(engine: Engine, reservation: Reservation) -> None:
    header = reservation.header
    assert header is not None
    first = header.first_logprob if header.HasField("first_logprob") else None
    engine.handoff.admit_prefilled(
        reservation.request_id, reservation.prompt_token_ids, header.first_token_id, reservation.params,
        first_logprob=first.logprob if first is not None else None,
        first_top_logprobs=dict(first.top_logprobs) if first is not None and reservation.params.logprobs else None,
        num_prior_draws=reservation.num_prior_draws,
    )
