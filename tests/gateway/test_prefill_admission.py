"""Admission by the prefill pool's queue depth (``gateway/admission.py``, #25): a saturated
pool queues requests at the gateway in arrival order, bounded in number and time, and
refuses with RESOURCE_EXHAUSTED only past those bounds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from gateway.admission import AdmissionLimits, PrefillAdmission
from plumbing.rpc import ServiceError


def _worker(queued: int) -> SimpleNamespace:
    """What the gate reads of a prefill worker: its reported queue and what was routed since."""
    return SimpleNamespace(load=SimpleNamespace(num_queued_prefill_tokens=queued), num_routed_prefill_tokens=0)


def _gate(workers: list[SimpleNamespace], max_tokens: int = 1000, max_waiting: int = 3,
          max_wait_s: float = 30.0) -> PrefillAdmission:
    return PrefillAdmission(lambda: workers, AdmissionLimits(max_tokens, max_waiting, max_wait_s))  # type: ignore[arg-type,return-value]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_room_in_the_pool_admits_at_once_and_a_ticket_counts_until_closed() -> None:
    async def run() -> None:
        gate = _gate([_worker(600)])
        ticket = await gate.enter(400, None)  # 600 + 400 = the limit
        assert gate.passing_tokens == 400 and gate.depth() == 1000
        ticket.close()
        ticket.close()  # idempotent
        assert gate.passing_tokens == 0 and gate.depth() == 600

    asyncio.run(run())


def test_no_gate_without_live_prefill_workers_or_with_limit_0_and_an_empty_pool_takes_any_prompt() -> None:
    async def run() -> None:
        assert (await _gate([]).enter(10_000, None)).num_tokens == 10_000
        assert (await _gate([_worker(10**6)], max_tokens=0).enter(500, None)).num_tokens == 500
        assert (await _gate([_worker(0)]).enter(5000, None)).num_tokens == 5000  # longer than the limit

    asyncio.run(run())


def test_a_saturated_pool_queues_in_arrival_order_until_room_frees_up() -> None:
    async def run() -> None:
        worker = _worker(900)
        gate = _gate([worker], max_waiting=8)
        first = await gate.enter(100, None)  # 1000: full
        waiting = [asyncio.ensure_future(gate.enter(n, None)) for n in (300, 50, 50)]
        await _settle()
        assert gate.num_waiting == 3 and not any(w.done() for w in waiting)
        first.close()  # 900 queued: the 300 does not fit, and the 50s may not jump it
        await _settle()
        assert gate.num_waiting == 3 and not any(w.done() for w in waiting)
        worker.load.num_queued_prefill_tokens = 600  # a heartbeat: the worker computed 300 tokens
        await asyncio.wait_for(waiting[0], 5)  # found by the poll, not by a closed ticket
        await asyncio.wait_for(asyncio.gather(*waiting[1:]), 5)
        assert gate.passing_tokens == 400 and gate.num_waiting == 0
        for w in waiting:
            w.result().close()
        assert gate.passing_tokens == 0

    asyncio.run(run())


def test_past_max_waiting_a_request_is_refused_at_once_naming_the_bound() -> None:
    async def run() -> None:
        gate = _gate([_worker(1000)], max_waiting=2)
        waiting = [asyncio.ensure_future(gate.enter(10, None)) for _ in range(2)]
        await _settle()
        with pytest.raises(ServiceError) as refused:
            await gate.enter(10, None)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "admission_max_waiting=2" in str(refused.value) and gate.num_refused == 1
        assert gate.num_waiting == 2  # the refused one never queued
        for w in waiting:
            w.cancel()
        await _settle()
        assert gate.num_waiting == 0 and gate.passing_tokens == 0

    asyncio.run(run())


def test_a_wait_ends_at_the_cap_as_resource_exhausted_or_at_the_deadline_as_deadline_exceeded() -> None:
    async def run() -> None:
        gate = _gate([_worker(1000)], max_wait_s=0.05)
        with pytest.raises(ServiceError) as capped:
            await gate.enter(10, None)
        assert capped.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "admission_max_wait_ms=50" in str(capped.value)
        with pytest.raises(ServiceError) as late:
            await gate.enter(10, 0.02)  # the client's deadline comes first
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert gate.num_waiting == 0 and gate.passing_tokens == 0 and gate.num_refused == 1

    asyncio.run(run())


def test_a_waiter_that_gives_up_leaves_the_queue_and_the_next_one_is_served() -> None:
    async def run() -> None:
        gate = _gate([_worker(0)], max_waiting=4)
        big = await gate.enter(1000, None)
        cancelled = asyncio.ensure_future(gate.enter(600, None))
        small = asyncio.ensure_future(gate.enter(100, None))
        await _settle()
        cancelled.cancel()
        await _settle()
        assert gate.num_waiting == 1
        big.close()
        ticket = await asyncio.wait_for(small, 5)
        assert gate.passing_tokens == 100 and gate.num_waiting == 0
        ticket.close()

    asyncio.run(run())
