"""The prefill worker's keep-alive for its decode reservation (``prefill_worker/lease_keeper.py``,
#25): it renews while this worker makes progress (and not once it made none for the stall
bound), stops when the decode worker says the reservation ended or no lease applies, and
tries again after a transient failure."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefill_worker.lease_keeper import keep_lease
from splitserve_api.v1 import kv_transfer_pb2, prefill_pb2

TARGET = prefill_pb2.DecodeTarget(address="127.0.0.1:1", transfer_id=7, incarnation=3, transfer_secret=bytes(16))


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FakeDecode:
    """Answers ``RenewLease`` from a script: a lease in ms, or a status code to fail with."""

    def __init__(self, answers: list[int | grpc.StatusCode], then: int | grpc.StatusCode = 30) -> None:
        self.answers = list(answers)
        self.then = then
        self.calls: list[kv_transfer_pb2.LeaseRenewal] = []

    async def RenewLease(self, renewal: kv_transfer_pb2.LeaseRenewal, timeout: float) -> kv_transfer_pb2.LeaseGrant:  # noqa: N802
        self.calls.append(renewal)
        answer = self.answers.pop(0) if self.answers else self.then
        if isinstance(answer, grpc.StatusCode):
            raise _error(answer)
        return kv_transfer_pb2.LeaseGrant(lease_ms_left=answer)


def test_it_renews_while_the_worker_makes_progress_and_names_the_reservation() -> None:
    async def run() -> None:
        decode, steps = FakeDecode([]), [0]

        def progress() -> int:
            steps[0] += 1  # an engine step between every two looks
            return steps[0]

        keeper = asyncio.ensure_future(keep_lease(lambda: decode, TARGET, progress, 5.0))  # type: ignore[arg-type,return-value]
        while len(decode.calls) < 4:
            await asyncio.sleep(0.005)
        keeper.cancel()
        first = decode.calls[0]
        assert (first.transfer_id, first.transfer_secret, first.decode_incarnation) == (7, bytes(16), 3)

    asyncio.run(run())


def test_a_stalled_worker_stops_renewing_and_starts_again_when_it_moves() -> None:
    async def run() -> None:
        decode, steps, moving = FakeDecode([]), [0], [True]

        def progress() -> int:
            steps[0] += moving[0]  # a step between every two looks while moving
            return steps[0]

        keeper = asyncio.ensure_future(keep_lease(lambda: decode, TARGET, progress, 5.0, stall_s=0.05))  # type: ignore[arg-type,return-value]
        while len(decode.calls) < 3:
            await asyncio.sleep(0.005)
        moving[0] = False
        await asyncio.sleep(0.15)  # past the stall bound
        stalled = len(decode.calls)
        await asyncio.sleep(0.2)  # twenty renewal intervals of a 30 ms lease
        assert len(decode.calls) == stalled  # no progress for stall_s: no renewal
        moving[0] = True  # the engine steps again
        while len(decode.calls) == stalled:
            await asyncio.sleep(0.005)
        keeper.cancel()

    asyncio.run(run())


@pytest.mark.parametrize("final", [0, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION])
def test_it_stops_when_the_pages_are_in_or_the_reservation_is_gone(final: int | grpc.StatusCode) -> None:
    async def run() -> None:
        decode, steps = FakeDecode([30, final]), iter(range(10**6))
        num_granted = await asyncio.wait_for(keep_lease(lambda: decode, TARGET, lambda: next(steps), 5.0), 5)  # type: ignore[arg-type,return-value]
        assert num_granted == 1 and len(decode.calls) == 2

    asyncio.run(run())


def test_a_transient_failure_is_tried_again_at_the_next_tick() -> None:
    async def run() -> None:
        decode = FakeDecode([grpc.StatusCode.UNAVAILABLE, 0])
        num_granted = await asyncio.wait_for(keep_lease(lambda: decode, TARGET, lambda: 0, 5.0), 5)  # type: ignore[arg-type,return-value]
        assert num_granted == 0 and len(decode.calls) == 2

    asyncio.run(run())
