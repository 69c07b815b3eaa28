"""OpThread: one thread that runs a channel direction's ops strictly in submission order.

An op runs in up to two steps on the worker thread: ``start()`` posts it to the transport
and returns either None (the op is complete) or a ``finish()`` callable that waits for it.
With ``depth`` > 1 the worker starts up to ``depth`` queued ops before it finishes the
oldest, so a transport can have several receives posted ahead (see gloo.py). Ops are
started, and finished, in submission order::

    queue (submitted) ──start──▶ started (≤ depth, oldest first) ──finish──▶ future settled

State owned here (guarded by ``_lock``): the queue, the futures of started ops, and the
terminal error. Once :meth:`fail_all` has run, the worker is terminal: queued and started
futures have failed, and every later submit fails at once with the same error.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

Finish = Callable[[], None]
Op = Callable[[], Finish | None]


def _settle(future: Future[None], error: BaseException | None) -> None:
    """Complete ``future`` unless it is already done (a concurrent fail_all won the race)."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


class OpThread:
    """Runs submitted ops in submission order on its own daemon thread.

    ``submit``, ``fail_all`` and ``stop`` may be called from any thread; ops' ``start`` and
    ``finish`` run only on the worker thread. When either raises, the worker thread calls
    ``on_error(exc)``, which returns the error to fail the op's future with; the owner uses
    that call to break the channel (``fail_all`` on this worker and its sibling). Once
    terminal, no queued op starts, but started ops are still finished (their futures have
    failed already), so the transport lets go of their tensors before the worker drops
    them. Futures are settled outside the lock, so their done-callbacks may submit again.
    """

    def __init__(
        self, name: str, on_error: Callable[[Exception], BaseException], depth: int = 1
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._on_error = on_error
        self._depth = depth
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[tuple[Op, Future[None]]] = deque()
        self._in_flight: deque[Future[None]] = deque()  # started, not yet settled by us
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, op: Op) -> Future[None]:
        """Queue ``op``; the future completes when it has run (or fails with the error)."""
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()  # RUNNING futures cannot be cancelled
        with self._lock:
            error = self._error
            if error is None:
                self._queue.append((op, future))
                self._wakeup.notify()
        if error is not None:
            _settle(future, error)
        return future

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued and started future and refuse later ops (first error kept)."""
        with self._lock:
            if self._error is None:
                self._error = error
            doomed = [future for _, future in self._queue]
            doomed += self._in_flight
            self._queue.clear()
        for future in doomed:
            _settle(future, error)

    def stop(self) -> None:
        """Let the thread exit once nothing is queued or started (call after ``fail_all``)."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify()

    def join(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True when it has exited."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """True while an op is started and not finished."""
        with self._lock:
            return bool(self._in_flight)

    def _run(self) -> None:
        started: deque[tuple[Future[None], Finish]] = deque()
        while True:
            with self._lock:
                while not self._queue and not started and not self._stopping:
                    self._wakeup.wait()
                take = bool(self._queue) and len(started) < self._depth
                if take:
                    op, future = self._queue.popleft()
                    self._in_flight.append(future)
                elif not started:
                    return  # stopping, nothing queued or started
            if take:
                finish = self._start(future, op)
                if finish is not None:
                    started.append((future, finish))
            else:
                self._finish(*started.popleft())

    def _start(self, future: Future[None], op: Op) -> Finish | None:
        try:
            finish = op()
        except Exception as exc:  # noqa: BLE001 - every failure must reach the future
            self._complete(future, self._fail(exc))
            return None
        if finish is None:
            self._complete(future, None)
        return finish

    def _finish(self, future: Future[None], finish: Finish) -> None:
        try:
            finish()
        except Exception as exc:  # noqa: BLE001
            self._complete(future, self._fail(exc))
            return
        self._complete(future, None)

    def _fail(self, exc: Exception) -> BaseException:
        """The error for a failed step: the first failure breaks the owner (``on_error``);
        once terminal, later failures are its consequences and get the terminal error."""
        with self._lock:
            error = self._error
        return error if error is not None else self._on_error(exc)

    def _complete(self, future: Future[None], error: BaseException | None) -> None:
        with self._lock:
            self._in_flight.remove(future)
        _settle(future, error)  # a no-op when fail_all failed it already
