"""Transfer: the thread-safe state of one KV hand-off from a prefill to a decode worker.

States move forward only; FAILED is reachable from any non-terminal state and absorbs::

    PENDING ──▶ BOOTSTRAPPING ──▶ TRANSFERRING ──▶ DONE
       │              │                 │
       └──────────────┴────────┬────────┘
                               ▼
                            FAILED   (first reason kept)

Forward skips are allowed (PENDING → TRANSFERRING when the channel already exists).
DONE and FAILED are terminal. Any thread may advance, fail or wait.
"""

from __future__ import annotations

import enum
import threading
import time


class TransferState(enum.Enum):
    PENDING = "pending"  # announced, nothing done yet
    BOOTSTRAPPING = "bootstrapping"  # channel handshake / rendezvous in progress
    TRANSFERRING = "transferring"  # pages on the wire
    DONE = "done"  # pages unpacked on the decode side
    FAILED = "failed"  # gave up; ``Transfer.error`` says why

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_FORWARD_RANK = {
    TransferState.PENDING: 0,
    TransferState.BOOTSTRAPPING: 1,
    TransferState.TRANSFERRING: 2,
    TransferState.DONE: 3,
}


class InvalidTransition(RuntimeError):
    """A transition the state machine forbids (backward, repeated, or out of a terminal state)."""


class Transfer:
    """One KV hand-off. ``state``/``error`` are guarded by one condition variable."""

    def __init__(self, transfer_id: int) -> None:
        self.transfer_id = transfer_id
        self._cond = threading.Condition()
        self._state = TransferState.PENDING
        self._error: str | None = None
        self._entered_at = {TransferState.PENDING: time.monotonic()}

    @property
    def state(self) -> TransferState:
        with self._cond:
            return self._state

    @property
    def error(self) -> str | None:
        """The first failure reason once FAILED, else None."""
        with self._cond:
            return self._error

    @property
    def finished(self) -> bool:
        """True in DONE or FAILED."""
        with self._cond:
            return self._state.terminal

    @property
    def entered_at(self) -> dict[TransferState, float]:
        """``time.monotonic()`` at which each state reached so far was entered (a copy)."""
        with self._cond:
            return dict(self._entered_at)

    def advance(self, state: TransferState) -> None:
        """Move forward to ``state``; InvalidTransition if that is not strictly forward."""
        if state is TransferState.FAILED:
            raise InvalidTransition(f"transfer {self.transfer_id}: use fail(reason) to fail it")
        with self._cond:
            current = self._state
            if current.terminal:
                raise InvalidTransition(
                    f"transfer {self.transfer_id} is {current.name}, cannot move to {state.name}"
                )
            if _FORWARD_RANK[state] <= _FORWARD_RANK[current]:
                raise InvalidTransition(
                    f"transfer {self.transfer_id}: {current.name} -> {state.name} is not forward"
                )
            self._enter(state)

    def fail(self, reason: str) -> bool:
        """Move to FAILED from any non-terminal state (True); from DONE or FAILED it is a
        no-op returning False, and an earlier failure's reason is kept."""
        with self._cond:
            if self._state.terminal:
                return False
            self._error = reason
            self._enter(TransferState.FAILED)
            return True

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until DONE/FAILED or ``timeout`` seconds; return the state at that point."""
        with self._cond:
            self._cond.wait_for(lambda: self._state.terminal, timeout)
            return self._state

    def _enter(self, state: TransferState) -> None:  # caller holds _cond
        self._state = state
        self._entered_at[state] = time.monotonic()
        self._cond.notify_all()

    def __repr__(self) -> str:
        with self._cond:
            extra = f", error={self._error!r}" if self._error is not None else ""
            return f"Transfer(id={self.transfer_id}, state={self._state.name}{extra})"
