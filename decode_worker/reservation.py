"""One remote prefill on the decode worker, from its blocks being taken to its admission: the
only record of a KV hand-off here, with the only state machine::

    RESERVED ──announce──▶ RECEIVING ──last page written──▶ RECEIVED ──admit──▶ ADMITTED
        │                      │                                │
        └──────────────────────┴──────── fail(reason) ──────────┴──▶ FAILED

* RESERVED: the blocks belong to the engine's request under the same id, whose status is
  WAITING_FOR_REMOTE_KVS (the engine's whole view of a hand-off, until ADMITTED); the
  transfer id and secret went to the gateway; no pages were announced.
* RECEIVING: the prefill worker's announce was accepted on one KV channel; a receive is posted
  per message, and each landing message's pages are written into the blocks.
* RECEIVED: every page is written; the admission is queued on the engine thread. A lease
  no longer ends it (the pages are here).
* ADMITTED: the engine's request left WAITING_FOR_REMOTE_KVS (WAITING to join the batch,
  then RUNNING); its status is the only state from here on.
* FAILED: the pages will not be used; the engine thread frees the blocks once (the engine's
  request ends FINISHED_ABORTED; ``ReservationTable``). ``error`` holds the first reason.

The lease (``lease_deadline``) ends a reservation only before its pages are all written
(``expire``). ``renew`` is the one change that is not a phase transition: while RESERVED or
RECEIVING, the prefill worker computing its pages (``RenewLease``) moves the deadline to a
full lease from now, never past ``granted_at`` + the hold cap, and never once the lease ran
out (the engine thread frees it at its next tick). A prefill worker that dies or stalls
stops renewing, and the lease runs out as before.

Every transition is a method that holds ``lock``, the lock page writes hold too, so a lease
expiring on the engine thread, an announce on the event loop and a page landing on the
receiver thread see one state each and one order: a transition the diagram does not draw
raises ``InvalidTransition`` and changes nothing. Nothing else writes ``phase``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from plumbing.identity import frame_tag
from splitserve_api.v1 import kv_transfer_pb2


class Phase(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    RECEIVED = "received"
    ADMITTED = "admitted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.ADMITTED, Phase.FAILED)


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.RESERVED: frozenset({Phase.RECEIVING, Phase.FAILED}),
    Phase.RECEIVING: frozenset({Phase.RECEIVED, Phase.FAILED}),
    Phase.RECEIVED: frozenset({Phase.ADMITTED, Phase.FAILED}),
    Phase.ADMITTED: frozenset(),
    Phase.FAILED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A transition the diagram does not draw (the reservation is unchanged)."""


@dataclass(eq=False)
class Reservation:
    """A remote prefill's blocks here and the hand-off of its pages (see the module doc)."""

    request_id: str
    transfer_id: int
    secret: bytes = field(repr=False)
    block_ids: list[int]
    prompt_token_ids: list[int] = field(repr=False)
    params: SamplingParams = field(repr=False)
    lease_deadline: float
    num_prior_draws: int = 0  # a migrated request: tokens of the prompt generated elsewhere
    num_cached_blocks: int = 0  # leading blocks that are this worker's prefix-cache hits (no pages)
    header: kv_transfer_pb2.TransferHeader | None = field(default=None, repr=False)  # once RECEIVING
    recv_started: float = 0.0
    num_chunks_left: int = 0  # messages announced and not yet written
    error: str | None = None  # why it FAILED (the first reason)
    granted_at: float = field(default_factory=time.monotonic)  # the blocks were taken
    num_renewals: int = 0  # leases renewed by the prefill worker
    _phase: Phase = Phase.RESERVED
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def phase(self) -> Phase:
        return self._phase

    def __post_init__(self) -> None:
        self._lease_s = max(self.lease_deadline - self.granted_at, 0.0)  # one lease's length

    @property
    def num_fresh_blocks(self) -> int:
        """The blocks whose pages travel (after the prefix-cache hits)."""
        return len(self.block_ids) - self.num_cached_blocks

    @property
    def tag(self) -> int:
        """The frame tag the pages of this hand-off must arrive with."""
        return frame_tag(self.transfer_id, self.secret)

    # -- transitions (each under ``lock``) --------------------------------------------------
    def start_receiving(self, header: kv_transfer_pb2.TransferHeader, num_messages: int) -> None:
        """RESERVED → RECEIVING: the announce of ``num_messages`` messages was accepted."""
        with self.lock:
            self._move(Phase.RECEIVING)
            self.header = header
            self.num_chunks_left = num_messages
            self.recv_started = time.monotonic()

    def write_chunk(self, write: Callable[[], None]) -> bool | None:
        """Receiver thread: run ``write`` (pages into the blocks) while RECEIVING; True when
        that was the last message (→ RECEIVED), False when more are due, None when the
        reservation no longer takes pages (the write did not run). A ``write`` that raises
        fails the reservation and re-raises."""
        with self.lock:
            if self._phase is not Phase.RECEIVING:
                return None
            try:
                write()
            except Exception as exc:
                self._fail(f"writing pages failed: {exc}")
                raise
            self.num_chunks_left -= 1
            if self.num_chunks_left:
                return False
            self._move(Phase.RECEIVED)
            return True

    def fail(self, reason: str) -> bool:
        """Any live phase → FAILED (True); a no-op returning False once ADMITTED or FAILED
        (the first reason is kept)."""
        with self.lock:
            return self._fail(reason)

    def expire(self, now: float) -> bool:
        """Engine thread: FAILED when the lease ran out before every page was written (True)."""
        with self.lock:
            if now < self.lease_deadline or self._phase not in (Phase.RESERVED, Phase.RECEIVING):
                return False
            return self._fail("lease expired before the KV pages arrived")

    def renew(self, now: float, max_hold_s: float) -> float | None:
        """The prefill worker's keep-alive (any thread). RESERVED or RECEIVING with the lease
        still running: the lease runs a full length from ``now``, capped at ``granted_at`` +
        ``max_hold_s``; returns the seconds it now has left. RECEIVED or ADMITTED: 0.0 (no lease
        applies any more). FAILED, or a lease that already ran out: None (it ends; never revived)."""
        with self.lock:
            if self._phase in (Phase.RECEIVED, Phase.ADMITTED):
                return 0.0
            if self._phase is Phase.FAILED or now >= self.lease_deadline:
                return None
            cap = self.granted_at + max_hold_s
            self.lease_deadline = max(self.lease_deadline, min(now + self._lease_s, cap))
            self.num_renewals += 1
            return self.lease_deadline - now

    def admit(self, take: Callable[[], None]) -> None:
        """Engine thread: RECEIVED → ADMITTED once ``take()`` (the engine adopting the
        blocks) returned; if it raises, nothing changed."""
        with self.lock:
            if Phase.ADMITTED not in ALLOWED[self._phase]:
                self._move(Phase.ADMITTED)  # raises InvalidTransition
            take()
            self._move(Phase.ADMITTED)

    def release(self, reason: str, free: Callable[[], None]) -> None:
        """Engine thread: FAILED (unless it already is), then ``free()`` the blocks, with no
        page write in progress or to come."""
        with self.lock:
            if self._phase is Phase.ADMITTED:
                raise InvalidTransition(f"reservation {self.transfer_id}: ADMITTED blocks are the engine's")
            self._fail(reason)
            free()

    def _fail(self, reason: str) -> bool:  # caller holds lock
        if self._phase.terminal:
            return False
        self._move(Phase.FAILED)
        self.error = reason
        return True

    def _move(self, to: Phase) -> None:  # caller holds lock
        if to not in ALLOWED[self._phase]:
            raise InvalidTransition(f"reservation {self.transfer_id}: {self._phase.name} -> {to.name}")
        self._phase = to
