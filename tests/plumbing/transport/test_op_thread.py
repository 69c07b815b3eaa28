"""OpThread: submission order, the start/finish window, failure and stop."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from plumbing.transport import TransportError
from plumbing.transport.op_thread import Finish, OpThread

GUARD_S = 30.0


class Broken:
    """A stand-in owner: the first error breaks both of its workers."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.workers: list[OpThread] = []

    def on_error(self, exc: Exception) -> BaseException:
        self.errors.append(exc)
        error = TransportError(f"broken: {exc}")
        for worker in self.workers:
            worker.fail_all(error)
        return error

    def worker(self, depth: int = 1) -> OpThread:
        worker = OpThread("test-worker", self.on_error, depth=depth)
        self.workers.append(worker)
        return worker


def stop(worker: OpThread) -> None:
    worker.fail_all(TransportError("test over"))
    worker.stop()
    assert worker.join(GUARD_S)


def test_ops_run_in_submission_order_from_many_threads() -> None:
    worker = Broken().worker()
    ran: list[tuple[int, int]] = []
    futures = []
    lock = threading.Lock()

    def submit_some(caller: int) -> None:
        for i in range(100):
            with lock:  # submission order is defined by this lock
                futures.append(worker.submit(lambda c=caller, i=i: ran.append((c, i))))

    threads = [threading.Thread(target=submit_some, args=(c,)) for c in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for future in futures:
        future.result(GUARD_S)
    for caller in range(4):
        assert [i for c, i in ran if c == caller] == list(range(100))
    assert len(ran) == 400
    stop(worker)


def test_depth_bounds_started_ops_and_finishes_oldest_first() -> None:
    worker = Broken().worker(depth=3)
    events: list[str] = []
    gate = threading.Event()

    def op(i: int) -> Callable[[], Finish | None]:
        def start() -> Finish:
            events.append(f"start{i}")

            def finish() -> None:
                gate.wait(GUARD_S)
                events.append(f"finish{i}")

            return finish

        return start

    futures = [worker.submit(op(i)) for i in range(5)]
    gate.set()
    for future in futures:
        future.result(GUARD_S)
    assert events[:3] == ["start0", "start1", "start2"]  # three started before any finished
    assert [e for e in events if e.startswith("finish")] == [f"finish{i}" for i in range(5)]
    for i in range(3, 5):  # op i starts only after op i-3 finished
        assert events.index(f"finish{i - 3}") < events.index(f"start{i}")
    stop(worker)


def test_failure_fails_queued_and_started_ops_and_later_submits() -> None:
    owner = Broken()
    worker, sibling = owner.worker(depth=2), owner.worker()
    release = threading.Event()
    finished_after_failure = threading.Event()

    def boom() -> Finish:
        def finish() -> None:
            release.wait(GUARD_S)
            raise OSError("wire cut")

        return finish

    def started_behind() -> Finish:
        release.set()  # op 0 fails only once this op has started too

        def finish() -> None:
            finished_after_failure.set()  # still run, so the transport lets go

        return finish

    failing = worker.submit(boom)
    started = worker.submit(started_behind)
    queued = worker.submit(lambda: None)
    for future in (failing, started, queued):
        with pytest.raises(TransportError, match="broken: wire cut"):
            future.result(GUARD_S)
    assert sibling.join(0) is False  # the sibling thread lives on, but refuses work:
    assert isinstance(worker.submit(lambda: None).exception(GUARD_S), TransportError)
    assert isinstance(sibling.submit(lambda: None).exception(GUARD_S), TransportError)
    assert finished_after_failure.wait(GUARD_S)
    assert len(owner.errors) == 1
    stop(worker)
    stop(sibling)


def test_stop_lets_the_thread_exit() -> None:
    worker = Broken().worker()
    worker.submit(lambda: None).result(GUARD_S)
    assert not worker.busy
    stop(worker)


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        OpThread("bad", lambda exc: exc, depth=0)
