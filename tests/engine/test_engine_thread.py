"""EngineThread: the engine's only thread; calls between steps, outputs handed off, failure stops it."""

import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from engine.engine_thread import EngineThread, EngineStopped
from engine.outputs import EngineLoad, RequestOutput


class FakeEngine:
    """Steps while it has pending work; each step emits one output per pending id."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.pending: list[str] = []
        self.num_steps = 0
        self.fail_at = fail_at
        self.thread_ids: set[int] = set()
        self.stats = SimpleNamespace(num_prefill_tokens=0)  # a step computes a 3-token prompt per new id

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def prepare_some(self) -> bool:  # nothing to prepare (FakePreparingEngine has pieces)
        return False

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise RuntimeError("boom")
        done, self.pending = self.pending, []
        self.stats.num_prefill_tokens += 3 * sum(not r.startswith("decode") for r in done)
        return [RequestOutput(request_id=r, new_token_ids=[2], finished=True) for r in done]

    def load(self) -> EngineLoad:
        return EngineLoad(num_blocks_total=8, num_blocks_free=8, num_running=0,
                          num_waiting=len(self.pending), num_queued_prefill_tokens=0)


def _wait_until(done: Callable[[], bool]) -> None:
    """Poll (the loop runs on its own thread) until ``done()``, for at most 5 s."""
    for _ in range(500):
        if done():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the engine thread did not get there within 5 s")


def test_calls_and_steps_run_on_one_thread_and_outputs_are_handed_off() -> None:
    engine = FakeEngine()
    got: list[str] = []
    delivered = threading.Event()

    def on_outputs(outs: list[RequestOutput]) -> None:
        got.extend(o.request_id for o in outs)
        if len(got) == 3:
            delivered.set()

    loop = EngineThread(engine, on_outputs)
    loop.start()
    try:
        for rid in ("a", "b", "c"):
            assert loop.call(lambda e, rid=rid: (e.pending.append(rid), threading.get_ident())[1]).result(5)
        assert delivered.wait(5)
        assert sorted(got) == ["a", "b", "c"]
        assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
        assert loop.call(lambda e: threading.get_ident()).result(5) in engine.thread_ids
    finally:
        loop.stop()
    with pytest.raises(EngineStopped):
        loop.call(lambda e: None).result(5)


def test_a_failing_step_stops_the_loop_and_reports_once() -> None:
    engine = FakeEngine(fail_at=2)
    failures: list[BaseException] = []
    loop = EngineThread(engine, lambda outs: None, on_failure=failures.append)
    loop.start()
    loop.call(lambda e: e.pending.append("x")).result(5)
    loop.call(lambda e: e.pending.append("y")).result(5)
    loop._thread.join(5)
    assert not loop._thread.is_alive()
    assert [str(f) for f in failures] == ["boom"] and str(loop.failure) == "boom"
    with pytest.raises(EngineStopped):
        loop.call(lambda e: None).result(5)


def test_an_exception_in_a_call_goes_to_its_caller_only() -> None:
    loop = EngineThread(FakeEngine(), lambda outs: None)
    loop.start()
    try:
        with pytest.raises(ValueError, match="bad"):
            loop.call(lambda e: (_ for _ in ()).throw(ValueError("bad"))).result(5)
        assert loop.call(lambda e: 7).result(5) == 7
    finally:
        loop.stop()


def test_each_step_is_reported_with_its_kind() -> None:
    engine = FakeEngine()
    steps: list[tuple[float, bool]] = []
    reported = threading.Event()

    def on_step(seconds: float, prefill: bool) -> None:
        steps.append((seconds, prefill))
        if len(steps) == 2:
            reported.set()

    loop = EngineThread(engine, lambda outs: None, on_step=on_step)
    loop.start()
    try:
        loop.call(lambda e: e.pending.append("a")).result(5)
        _wait_until(lambda: engine.num_steps >= 1)
        loop.call(lambda e: e.pending.append("decode-a")).result(5)
        assert reported.wait(5)
    finally:
        loop.stop()
    assert [prefill for _, prefill in steps] == [True, False] and all(s >= 0 for s, _ in steps)


class FakePreparingEngine(FakeEngine):
    """``pieces`` pieces of lazy preparation; the first waits for ``release``. Every piece,
    call and step goes into ``log`` in the order the loop ran them."""

    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.pieces = pieces
        self.done = 0
        self.log: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def prepare_some(self) -> bool:
        if self.done == 0:
            self.started.set()
            assert self.release.wait(5)
        self.log.append(f"prep{self.done}")
        self.done += 1
        return self.done < self.pieces

    def step(self) -> list[RequestOutput]:
        self.log.append("step")
        return super().step()


def test_an_idle_loop_prepares_piece_by_piece_and_serves_calls_and_steps_first() -> None:
    # A call (here one that queues a request) made while a piece is being made runs right after
    # that piece, then the request's step, and only then, idle again, the next piece: the
    # preparation never holds back work by more than one piece, and stops once all are made.
    engine = FakePreparingEngine(pieces=3)
    loop = EngineThread(engine, lambda outs: None)
    loop.start()
    try:
        assert engine.started.wait(5)
        queued = loop.call(lambda e: (e.log.append("call"), e.pending.append("a")))
        engine.release.set()
        queued.result(5)
        assert loop.call(lambda e: None).result(5) is None
        _wait_until(lambda: engine.done >= 3)
        loop.call(lambda e: None).result(5)  # a few idle iterations later: no fourth piece
        threading.Event().wait(0.1)
    finally:
        loop.stop()
    assert engine.log == ["prep0", "call", "step", "prep1", "prep2"]


def test_a_loop_told_not_to_prepare_never_does() -> None:
    engine = FakePreparingEngine(pieces=3)
    engine.release.set()
    loop = EngineThread(engine, lambda outs: None, prepare_when_idle=False)
    loop.start()
    try:
        loop.call(lambda e: e.pending.append("a")).result(5)
        _wait_until(lambda: engine.num_steps >= 1)
        loop.call(lambda e: None).result(5)
    finally:
        loop.stop()
    assert engine.log == ["step"] and engine.done == 0
