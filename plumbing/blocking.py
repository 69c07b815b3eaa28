"""Blocking calls the event loop must never wait for at shutdown: KV channel handshakes.

Forming a Gloo group or an NCCL communicator blocks until the peer joins or the channel's
timeout passes, and cannot be interrupted. Run on an executor, such a call would hold up the
process's exit (``asyncio.run`` and the interpreter join executor threads) for up to that
timeout, past any SIGTERM grace. ``DaemonCalls`` runs each call on a daemon thread of its
own instead, and bounds them: at most ``max_running`` threads at once (a slot is freed when
its thread ends, not when the caller gives up) and ``max_queued`` callers waiting for a slot;
beyond that a call is refused at once with RESOURCE_EXHAUSTED, so a flood of handshakes
cannot queue work without end. Calls may name a ``key`` (a peer): one key has at most
``max_per_key`` calls running or queued, so a peer whose calls stall takes only its own
slots and others' calls go on in parallel. A caller waits at most its ``timeout_s``
(TimeoutError); its thread keeps its slot until it ends, so the call itself must be bounded
(the Gloo join is: ``plumbing.transport.gloo.connect_gloo``). A result nobody waits for any
more (the caller gave up) is handed to ``discard`` (e.g. closing a channel that formed too
late).

One owner: the event loop (``run``); the threads only post their outcome back to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import grpc
import structlog

from plumbing.rpc import ServiceError

T = TypeVar("T")
log = structlog.get_logger()


class DaemonCalls(Generic[T]):
    def __init__(self, name: str, max_running: int, max_queued: int,
                 discard: Callable[[T], None] | None = None, max_per_key: int | None = None) -> None:
        if max_running < 1 or max_queued < 0 or (max_per_key is not None and max_per_key < 1):
            raise ValueError(f"max_running and max_per_key must be >= 1 and max_queued >= 0, got "
                             f"{max_running}, {max_per_key}, {max_queued}")
        self.name = name
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_per_key = max_per_key
        self._discard = discard
        self._per_key: Counter[Hashable] = Counter()  # calls running or queued, by key
        self._slots = asyncio.Semaphore(max_running)
        self.num_queued = 0
        self.num_running = 0  # threads alive (read by tests)

    async def run(self, fn: Callable[[], T], key: Hashable = None, timeout_s: float | None = None) -> T:
        """``fn()`` on a daemon thread; its result or exception, or TimeoutError past
        ``timeout_s``. RESOURCE_EXHAUSTED when every slot is taken and ``max_queued`` callers
        already wait, or ``key`` has ``max_per_key`` calls in progress."""
        if self.max_per_key is not None and key is not None and self._per_key[key] >= self.max_per_key:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.name}: this peer has {self.max_per_key} calls in progress")
        if self._slots.locked() and self.num_queued >= self.max_queued:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many {self.name} calls in progress ({self.max_running} running)")
        self._per_key[key] += 1  # given back when its thread ends, or here if none started
        started: list[bool] = []
        try:
            return await asyncio.wait_for(self._call(fn, key, started), timeout_s)
        finally:
            if not started:
                self._key_done(key)

    def _key_done(self, key: Hashable) -> None:
        self._per_key[key] -= 1
        if not self._per_key[key]:
            del self._per_key[key]

    async def _call(self, fn: Callable[[], T], key: Hashable, started: list[bool]) -> T:
        self.num_queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_queued -= 1
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self.num_running += 1
        started.append(True)
        threading.Thread(target=self._body, args=(loop, fn, done, key), name=f"{self.name}-call",
                         daemon=True).start()
        return await done

    def _body(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], T], done: asyncio.Future[T],
              key: Hashable) -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller on the loop
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(self._finish, done, outcome, key)
        except RuntimeError:  # the loop is closed: nobody will ever take the result
            self._drop(outcome)

    def _finish(self, done: asyncio.Future[T], outcome: tuple[T | None, BaseException | None],
                key: Hashable) -> None:
        self.num_running -= 1
        self._slots.release()
        self._key_done(key)
        value, error = outcome
        if done.done():  # the caller gave up (cancelled, or past its timeout)
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
