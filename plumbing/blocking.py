"""Blocking calls the event loop must never wait for at shutdown: KV channel handshakes.

Forming a Gloo group or an NCCL communicator blocks until the peer joins or the channel's
timeout passes, and cannot be interrupted. Run on an executor, such a call would hold up the
process's exit (``asyncio.run`` and the interpreter join executor threads) for up to that
timeout, past any SIGTERM grace. ``DaemonCalls`` runs each call on a daemon thread of its
own instead, and bounds them: at most ``max_running`` threads at once (a slot is freed when
its thread ends, not when the caller gives up) and ``max_queued`` callers waiting for a slot;
beyond that a call is refused at once with RESOURCE_EXHAUSTED, so a flood of handshakes
cannot queue work without end. A result nobody waits for any more (the caller was
cancelled) is handed to ``discard`` (e.g. closing a channel that formed too late).

One owner: the event loop (``run``); the threads only post their outcome back to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc
import structlog

from plumbing.rpc import ServiceError

T = TypeVar("T")
log = structlog.get_logger()


class DaemonCalls(Generic[T]):
    def __init__(self, name: str, max_running: int, max_queued: int,
                 discard: Callable[[T], None] | None = None) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"max_running must be >= 1 and max_queued >= 0, got {max_running}, {max_queued}")
        self.name = name
        self.max_running = max_running
        self.max_queued = max_queued
        self._discard = discard
        self._slots = asyncio.Semaphore(max_running)
        self.num_queued = 0
        self.num_running = 0  # threads alive (read by tests)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a daemon thread; its result or exception. RESOURCE_EXHAUSTED when
        every slot is taken and ``max_queued`` callers already wait."""
        if self._slots.locked() and self.num_queued >= self.max_queued:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many {self.name} calls in progress ({self.max_running} running)")
        self.num_queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_queued -= 1
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self.num_running += 1
        threading.Thread(target=self._body, args=(loop, fn, done), name=f"{self.name}-call",
                         daemon=True).start()
        return await done

    def _body(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], T], done: asyncio.Future[T]) -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller on the loop
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(self._finish, done, outcome)
        except RuntimeError:  # the loop is closed: nobody will ever take the result
            self._drop(outcome)

    def _finish(self, done: asyncio.Future[T], outcome: tuple[T | None, BaseException | None]) -> None:
        self.num_running -= 1
        self._slots.release()
        value, error = outcome
        if done.done():  # the caller gave up (cancelled)
            self._drop(outcome)
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def _drop(self, outcome: tuple[T | None, BaseException | None]) -> None:
        value, error = outcome
        if error is not None:
            log.info("blocking_call.abandoned", call=self.name, error=str(error))
        elif self._discard is not None:
            self._discard(value)  # type: ignore[arg-type]
