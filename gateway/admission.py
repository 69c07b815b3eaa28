"""Admission by the prefill pool's queue depth (#25): a saturated pool queues requests here,
at the gateway, before their decode leg reserves anything, instead of deep in a prefill
worker's queue while a decode reservation waits for pages::

    remote-prefill attempt ──enter(prompt tokens)──▶ depth + tokens ≤ limit, nobody ahead? ──▶ ticket
                                   │ no                                                        │
                                   ▼                                                           │
              FIFO wait (≤ admission_max_wait_ms, the client's deadline)                        │
              more than admission_max_waiting already waiting: RESOURCE_EXHAUSTED at once      │
    the prefill leg is routed (its tokens now count in the worker's routed tokens) ◀────────────┘
        or the attempt ends: ticket.close()

* depth: the prompt tokens queued in the live prefill workers as each last reported
  (``WorkerLoad.num_queued_prefill_tokens``, every gateway's), plus those this gateway routed
  since (``routing.queued_prefill_tokens``), plus tickets granted here and not yet routed.
* limit: ``prefill_queue_max_tokens`` × live prefill workers. An empty pool takes any prompt
  (one longer than the limit is not refused for its length); no live prefill worker, or a
  limit of 0: no gate (those prompts prefill on a decode worker).
* Waiters are served in arrival order, on every closed ticket and at least every
  ``POLL_S`` (heartbeats change the reported depth); a waiter that gives up (deadline, cancel)
  leaves the queue. Past ``admission_max_wait_ms``: RESOURCE_EXHAUSTED naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from gateway.routing import queued_prefill_tokens
from gateway.workers import WorkerEntry
from plumbing.metrics import GatewayMetrics
from plumbing.rpc import ServiceError

POLL_S = 0.02  # how often waiters look at the reported depth again


@dataclass(frozen=True)
class AdmissionLimits:
    prefill_queue_max_tokens: int  # per live prefill worker; 0: no gate
    max_waiting: int  # requests waiting here at once; more: RESOURCE_EXHAUSTED
    max_wait_s: float  # the longest one request waits; then RESOURCE_EXHAUSTED


@dataclass(eq=False)
class Ticket:
    """A granted passage; its tokens count in the depth until ``close`` (idempotent)."""

    num_tokens: int
    _gate: PrefillAdmission = field(repr=False)
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._gate.passing_tokens -= self.num_tokens
            self._gate.serve()


@dataclass(eq=False)
class _Waiter:
    num_tokens: int
    granted: asyncio.Future[Ticket]


class PrefillAdmission:
    """The gate (event loop only)."""

    def __init__(self, live_prefill: Callable[[], list[WorkerEntry]], limits: AdmissionLimits,
                 metrics: GatewayMetrics | None = None) -> None:
        self._live = live_prefill
        self.limits = limits
        self._metrics = metrics
        if metrics is not None:
            metrics.admission_waiting.set_function(lambda: len(self._waiters))
        self._waiters: deque[_Waiter] = deque()
        self._poller: asyncio.Task[None] | None = None
        self.passing_tokens = 0  # granted tickets not yet routed
        self.num_refused = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def depth(self) -> int:
        return sum(queued_prefill_tokens(w) for w in self._live()) + self.passing_tokens

    def _fits(self, num_tokens: int) -> bool:
        per_worker = self.limits.prefill_queue_max_tokens
        workers = self._live()
        if not per_worker or not workers:
            return True
        depth = self.depth()
        return depth == 0 or depth + num_tokens <= per_worker * len(workers)

    async def enter(self, num_tokens: int, time_left: float | None) -> Ticket:
        """A ticket for a remote prefill of ``num_tokens``, at once or after the requests ahead."""
        if not self._waiters and self._fits(num_tokens):
            return self._grant(num_tokens)
        if len(self._waiters) >= self.limits.max_waiting:
            self._refused()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the prefill pool is saturated: {len(self._waiters)} requests already wait for it at this "
                f"gateway (admission_max_waiting={self.limits.max_waiting})"))
        waiter = _Waiter(num_tokens, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._ensure_poller()
        start = time.monotonic()
        wait_s = self.limits.max_wait_s if time_left is None else min(self.limits.max_wait_s, time_left)
        ticket: Ticket | None = None
        try:
            ticket = await asyncio.wait_for(asyncio.shield(waiter.granted), wait_s)
            return ticket
        except asyncio.TimeoutError:
            if time_left is not None and time_left <= self.limits.max_wait_s:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while waiting for the "
                                   "prefill pool") from None
            self._refused()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the prefill pool stayed saturated for admission_max_wait_ms="
                f"{int(self.limits.max_wait_s * 1000)}")) from None
        finally:
            self._leave(waiter, ticket)
            if self._metrics is not None:
                self._metrics.admission_wait.observe(time.monotonic() - start)

    def _refused(self) -> None:
        self.num_refused += 1
        if self._metrics is not None:
            self._metrics.admission_refused.inc()

    def _leave(self, waiter: _Waiter, ticket: Ticket | None) -> None:
        """A waiter stops waiting: out of the queue; a ticket granted that it did not take
        (it gave up at that moment) is closed."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if ticket is None:
            if waiter.granted.done() and not waiter.granted.cancelled():
                waiter.granted.result().close()
            else:
                waiter.granted.cancel()
        self.serve()

    def _grant(self, num_tokens: int) -> Ticket:
        self.passing_tokens += num_tokens
        return Ticket(num_tokens, self)

    def serve(self) -> None:
        """Grant waiters in arrival order while they fit."""
        while self._waiters and self._fits(self._waiters[0].num_tokens):
            waiter = self._waiters.popleft()
            if not waiter.granted.done():
                waiter.granted.set_result(self._grant(waiter.num_tokens))

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(POLL_S)
            self.serve()
