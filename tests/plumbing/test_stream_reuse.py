"""A retry can reach the same worker under the same request id while the previous attempt is
still being torn down (the chaos campaign caught an OK reply with one extra token this way: a
prefill worker killed after its pages were admitted, the gateway retrying on the same decode
worker, and an output of the aborted sequence delivered into the new stream). A worker opens
a new stream for an id only after the last one ended and the engine thread ran its cleanup,
so outputs made for the old attempt are dropped."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from engine.outputs import RequestOutput
from plumbing.engine_service import EngineServicer
from plumbing.metrics import WorkerMetrics


class FakeEngineThread:
    """Calls queue up until the test runs them, as the engine thread does between steps."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, Future]] = []

    def call(self, fn: object) -> Future:
        future: Future = Future()
        self.calls.append((fn, future))
        return future

    def run_calls(self) -> None:
        for _, future in self.calls:
            future.set_result(None)
        self.calls.clear()


def make_servicer() -> tuple[EngineServicer, FakeEngineThread]:
    servicer = EngineServicer.__new__(EngineServicer)
    servicer.loop = asyncio.get_running_loop()
    servicer.queues, servicer._streams = {}, {}  # noqa: SLF001
    servicer.metrics = WorkerMetrics.create("decode")
    servicer.engine_thread = thread = FakeEngineThread()  # type: ignore[assignment]
    return servicer, thread


def stray(rid: str) -> list[RequestOutput]:
    return [RequestOutput(request_id=rid, new_token_ids=[28])]


def test_outputs_of_an_ended_stream_never_reach_the_next_one_for_the_id() -> None:
    async def run() -> None:
        servicer, thread = make_servicer()
        first = await servicer.open_stream("7", "decoded")
        servicer.close_stream("7", lambda e: None)  # the gateway cancelled attempt 1
        retry = asyncio.ensure_future(servicer.open_stream("7", "decoded"))  # attempt 2 arrives at once
        await asyncio.sleep(0.01)
        assert not retry.done()  # it waits for attempt 1's cleanup
        servicer._on_outputs_threadsafe(stray("7"))  # noqa: SLF001 - the engine's last step for attempt 1
        thread.run_calls()  # then the cleanup (abort) runs on the engine thread
        second = await asyncio.wait_for(retry, 1)
        await asyncio.sleep(0.01)
        assert second.empty() and first.empty()
        servicer._on_outputs_threadsafe(stray("7"))  # noqa: SLF001 - attempt 2's own outputs arrive
        await asyncio.sleep(0.01)
        assert second.qsize() == 1

    asyncio.run(run())


def test_a_stream_that_finished_frees_its_id_at_once_and_a_stuck_one_is_refused() -> None:
    async def run() -> None:
        servicer, _ = make_servicer()
        await servicer.open_stream("8", "decoded")
        servicer.close_stream("8", None)  # finished: nothing to clean up
        await asyncio.wait_for(servicer.open_stream("8", "decoded"), 1)
        with pytest.raises(ValueError, match="already being decoded"):
            await servicer.open_stream("8", "decoded", wait_s=0.05)  # still open: refused after the wait

    asyncio.run(run())
