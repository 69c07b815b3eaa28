"""Runs an ``Engine`` on one dedicated thread; other threads (the gRPC event loop) talk to
it through ``call()``.

The engine is not thread-safe, so this thread is its only owner. Between steps it runs the
queued calls, then ``on_tick`` (lease expiry, reservation waiters and similar housekeeping),
then one ``engine.step()``, hands the outputs to ``on_outputs`` (which must not block:
services push them onto asyncio queues with ``call_soon_threadsafe``), so a slow client never
stalls the batch, and publishes ``load``, a snapshot other threads read instead of engine
state. When idle it waits on a condition, waking for new calls or every ``idle_tick_s``.

Until the model's lazy preparations are done (its weights packed for every row count:
``Engine.prepare_some``), an idle loop makes one piece instead of waiting, then looks for
calls and requests again: a fresh worker is registered and serving at once, and the first
burst it gets no longer pays for the packing inside its steps (a cold colocated worker's
first 16 prompts of 256 tokens had their last first token at 3.7 s where a warm one has it
at 2.3; serve_vs_vllm's TTFT P99 is that wave).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog

from engine.engine import Engine
from engine.outputs import EngineLoad, RequestOutput

T = TypeVar("T")


log = structlog.get_logger()


class EngineStopped(RuntimeError):
    """The engine thread is stopped (shut down, or its engine failed): calls are refused."""


class EngineThread:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_tick: Callable[[Engine], None] | None = None,
        idle_tick_s: float = 0.05,
        on_failure: Callable[[BaseException], None] | None = None,
        on_step: Callable[[float, bool], None] | None = None,
        prepare_when_idle: bool = True,
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_tick = on_tick
        self._on_failure = on_failure
        self._on_step = on_step  # (seconds, whether it computed prompt tokens) after each step
        self.failure: BaseException | None = None
        self._idle_tick_s = idle_tick_s
        self._preparing = prepare_when_idle  # until Engine.prepare_some has nothing left
        self._prepare_s = 0.0  # the time its pieces took
        self._calls: deque[tuple[Callable[[Engine], Any], Future[Any]]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-thread", daemon=True)
        self.num_steps = 0
        # Replaced (never mutated) by the engine thread after every iteration: any thread may
        # read it without touching engine state.
        self.load: EngineLoad = engine.load()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; pending calls fail with ``EngineStopped``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread before the next step (any thread may call)."""
        future: Future[T] = Future()
        with self._cv:
            if self._stopping:
                future.set_exception(EngineStopped("engine thread is stopped"))
                return future
            self._calls.append((fn, future))
            self._cv.notify_all()
        return future

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        """The loop; a failed step stops it (``failure`` is set, ``on_failure`` called)."""
        while True:
            with self._cv:
                if self._stopping:
                    break
                idle = not self._calls and not self.engine.has_unfinished_requests()
                if idle and not self._preparing:
                    self._cv.wait(self._idle_tick_s)
                calls = list(self._calls)
                self._calls.clear()
            if idle and self._preparing:
                self._prepare()
            self._run_calls(calls)
            self._tick()
            if self.engine.has_unfinished_requests():
                self._step()
            self.load = self.engine.load()
        with self._cv:
            pending = list(self._calls)
            self._calls.clear()
        for _, future in pending:
            future.set_exception(EngineStopped("engine thread is stopped"))

    def _prepare(self) -> None:
        """One piece of the engine's lazy preparation (module docstring); a failure is logged
        and ends the preparing (the first calls then make what is left, as without it)."""
        start = time.perf_counter()
        try:
            self._preparing = self.engine.prepare_some()
        except Exception:  # noqa: BLE001 - the calls that need a piece make it themselves
            log.exception("engine_thread.prepare_failed")
            self._preparing = False
            return
        self._prepare_s += time.perf_counter() - start
        if not self._preparing:
            log.info("engine_thread.prepared", seconds=round(self._prepare_s, 3))

    def _run_calls(self, calls: list[tuple[Callable[[Engine], Any], Future[Any]]]) -> None:
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _tick(self) -> None:
        if self._on_tick is None:
            return
        try:
            self._on_tick(self.engine)
        except Exception:  # noqa: BLE001 - housekeeping must not kill the loop
            log.exception("engine_thread.tick_failed")

    def _step(self) -> None:
        num_prompt_tokens = self.engine.stats.num_prefill_tokens
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the loop stops; the owner fails its requests
            log.exception("engine_thread.step_failed")
            self.failure = exc
            with self._cv:
                self._stopping = True
            if self._on_failure is not None:
                self._on_failure(exc)
            return
        self.num_steps += 1
        if self._on_step is not None:
            self._on_step(time.perf_counter() - start, self.engine.stats.num_prefill_tokens > num_prompt_tokens)
        if outputs:
            self._on_outputs(outputs)
