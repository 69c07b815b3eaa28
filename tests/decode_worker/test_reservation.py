"""The decode worker's one hand-off state machine (``decode_worker/reservation.py``, issue #23)
and the race it ends (issue #22 item 6: ``kv_inbox.py`` advanced the state on the event loop
without the lock while the engine thread failed it under the lock; a lease expiring in
between raised ``InvalidTransition``, which the client saw as INTERNAL)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from decode_worker.reservation import ALLOWED, InvalidTransition, Phase, Reservation
from engine import SamplingParams
from plumbing.identity import frame_tag
from plumbing.rpc import ServiceError
from splitserve_api.v1 import kv_transfer_pb2
from tests.decode_worker.test_kv_inbox import PREFILL_INCARNATION, Harness, _pages_like, _pair, until_phase

P = Phase
HEADER = kv_transfer_pb2.TransferHeader(first_token_id=1)


def _new() -> Reservation:
    return Reservation("1", 7, bytes(16), [0, 1], [5, 6, 7], SamplingParams(), lease_deadline=time.monotonic() + 60)


def _at(phase: Phase) -> Reservation:
    """A reservation brought to ``phase`` through its own methods."""
    r = _new()
    if phase is P.FAILED:
        assert r.fail("cancelled")
        return r
    if phase is not P.RESERVED:
        r.start_receiving(HEADER, 1)
    if phase in (P.RECEIVED, P.ADMITTED):
        assert r.write_chunk(lambda: None) is True
    if phase is P.ADMITTED:
        r.admit(lambda: None)
    assert r.phase is phase
    return r


# (method, the phase it moves to): every way a reservation changes.
METHODS: dict[str, tuple[Callable[[Reservation], object], Phase]] = {
    "start_receiving": (lambda r: r.start_receiving(HEADER, 1), P.RECEIVING),
    "write_chunk(last)": (lambda r: r.write_chunk(lambda: None), P.RECEIVED),
    "admit": (lambda r: r.admit(lambda: None), P.ADMITTED),
    "fail": (lambda r: r.fail("x"), P.FAILED),
}
# What each method does in each phase: "moves", "refused" (InvalidTransition) or "no-op"
# (returns None/False, nothing changes: a late page, a second failure).
EXPECTED = {
    P.RESERVED: {"start_receiving": "moves", "write_chunk(last)": "no-op", "admit": "refused", "fail": "moves"},
    P.RECEIVING: {"start_receiving": "refused", "write_chunk(last)": "moves", "admit": "refused", "fail": "moves"},
    P.RECEIVED: {"start_receiving": "refused", "write_chunk(last)": "no-op", "admit": "moves", "fail": "moves"},
    P.ADMITTED: {"start_receiving": "refused", "write_chunk(last)": "no-op", "admit": "refused", "fail": "no-op"},
    P.FAILED: {"start_receiving": "refused", "write_chunk(last)": "no-op", "admit": "refused", "fail": "no-op"},
}


@pytest.mark.parametrize("start", list(Phase))
@pytest.mark.parametrize("method", list(METHODS))
def test_every_transition_is_allowed_exactly_as_drawn(start: Phase, method: str) -> None:
    call, target = METHODS[method]
    r = _at(start)
    expected = EXPECTED[start][method]
    assert (expected == "moves") == (target in ALLOWED[start])  # the table is the diagram
    if expected == "refused":
        with pytest.raises(InvalidTransition):
            call(r)
        assert r.phase is start
    elif expected == "no-op":
        assert not call(r)
        assert r.phase is start
    else:
        call(r)
        assert r.phase is target


def test_nothing_moves_back_to_reserved_and_failed_keeps_the_first_reason() -> None:
    assert all(P.RESERVED not in targets for targets in ALLOWED.values())
    r = _at(P.RECEIVING)
    assert r.fail("first") and not r.fail("second")
    assert r.error == "first"


def test_a_failing_page_write_fails_the_reservation_and_a_refused_admission_changes_nothing() -> None:
    r = _at(P.RECEIVING)
    with pytest.raises(RuntimeError):
        r.write_chunk(lambda: (_ for _ in ()).throw(RuntimeError("bad pages")))
    assert r.phase is P.FAILED and "bad pages" in (r.error or "")
    r = _at(P.RECEIVED)
    with pytest.raises(ValueError):
        r.admit(lambda: (_ for _ in ()).throw(ValueError("first_token_id")))
    assert r.phase is P.RECEIVED


def test_the_lease_ends_a_reservation_only_before_its_pages_are_all_written() -> None:
    now = time.monotonic() + 3600
    for phase, expired in ((P.RESERVED, True), (P.RECEIVING, True), (P.RECEIVED, False), (P.ADMITTED, False)):
        r = _at(phase)
        assert r.expire(now) is expired
        assert r.phase is (P.FAILED if expired else phase)
    assert not _at(P.RESERVED).expire(time.monotonic())  # not due yet


# What ``renew`` (the prefill worker's keep-alive) does in each phase: "renews" (a full lease
# from now, the phase unchanged), "no lease" (0.0: the pages are all written) or "ended" (None).
RENEW = {P.RESERVED: "renews", P.RECEIVING: "renews", P.RECEIVED: "no lease", P.ADMITTED: "no lease",
         P.FAILED: "ended"}


@pytest.mark.parametrize("start", list(Phase))
def test_renew_moves_the_lease_only_while_the_pages_are_due(start: Phase) -> None:
    r = _at(start)
    r.lease_deadline = time.monotonic() + 5  # part of the 60 s lease was used
    now = time.monotonic()
    left = r.renew(now, max_hold_s=3600)
    assert r.phase is start  # never a phase change
    if RENEW[start] == "renews":
        assert left == pytest.approx(60, abs=0.5) and r.lease_deadline == pytest.approx(now + 60, abs=0.5)
        assert r.num_renewals == 1
    else:
        assert left == (0.0 if RENEW[start] == "no lease" else None) and r.num_renewals == 0


def test_renew_never_revives_a_lease_that_ran_out_and_never_passes_the_hold_cap() -> None:
    r = _at(P.RESERVED)
    r.lease_deadline = time.monotonic() - 0.01  # ran out; the engine thread has not ticked yet
    assert r.renew(time.monotonic(), max_hold_s=3600) is None
    assert r.expire(time.monotonic()) and r.phase is P.FAILED
    r = _at(P.RECEIVING)
    r.lease_deadline = r.granted_at + 5
    now = time.monotonic()
    left = r.renew(now, max_hold_s=10)  # the cap: 10 s after the grant, not a full 60 s lease
    assert left is not None and left <= 10 and r.lease_deadline <= r.granted_at + 10
    assert r.renew(r.granted_at + 9.5, max_hold_s=10) == pytest.approx(0.5, abs=1e-6)
    assert r.renew(r.granted_at + 10, max_hold_s=10) is None  # past the cap the lease runs out
    assert r.expire(r.granted_at + 10) and r.phase is P.FAILED


class _LayoutThatRunsTheEngineThread:
    """The inbox's layout, whose ``dtype`` is read right after the announce's transition and
    before the receives are posted: reading it runs ``between`` once, on another thread (the
    engine thread expiring the lease at that moment)."""

    def __init__(self, layout: object, between: Callable[[], None]) -> None:
        self._layout = layout
        self._between: Callable[[], None] | None = between

    def __getattr__(self, name: str) -> object:
        if name == "dtype" and self._between is not None:
            between, self._between = self._between, None
            thread = threading.Thread(target=between)
            thread.start()
            thread.join(10)
        return getattr(self._layout, name)


def test_a_lease_expiring_in_the_middle_of_an_announce_reaches_the_client_as_unavailable() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        sender, receiver = _pair()
        channel_id = h.inbox.channels.add(receiver, PREFILL_INCARNATION)
        a = await h.reserve("501", 40)
        a.lease_deadline = time.monotonic() - 1  # due: the engine thread's next tick expires it
        h.inbox.layout = _LayoutThatRunsTheEngineThread(h.inbox.layout, lambda: h.table.expire_leases(h.engine))
        h.inbox.announce(h.header(a, channel_id))  # no InvalidTransition (INTERNAL)
        assert a.phase is P.FAILED and a.transfer_id not in h.table.pending  # freed under the lock
        error = h.pushed["501"]
        assert isinstance(error, ServiceError) and error.code == grpc.StatusCode.UNAVAILABLE
        # The pages the prefill worker sends for it now land nowhere and leak nothing.
        await asyncio.wrap_future(sender.send(_pages_like(h, a, 1.0), tag=frame_tag(a.transfer_id, a.secret)))
        await asyncio.sleep(0.1)
        assert a.phase is P.FAILED and h.engine.num_free_blocks == h.engine.kv.num_blocks
        h.engine.check_integrity()
        sender.close()
        receiver.close()

    asyncio.run(run())


def test_a_lease_expired_before_the_announce_is_refused_with_failed_precondition() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        sender, receiver = _pair()
        channel_id = h.inbox.channels.add(receiver, PREFILL_INCARNATION)
        a = await h.reserve("502", 20)
        lookup = h.table.lookup

        def lookup_then_expire(transfer_id: int, secret: bytes) -> Reservation | None:
            found = lookup(transfer_id, secret)  # found live; the engine thread expires it now
            a.lease_deadline = time.monotonic() - 1
            thread = threading.Thread(target=h.table.expire_leases, args=(h.engine,))
            thread.start()
            thread.join(10)
            return found

        h.table.lookup = lookup_then_expire  # type: ignore[method-assign]
        with pytest.raises(ServiceError) as info:
            h.inbox.announce(h.header(a, channel_id))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await until_phase(a, P.FAILED)
        assert h.engine.num_free_blocks == h.engine.kv.num_blocks
        h.engine.check_integrity()
        sender.close()
        receiver.close()

    asyncio.run(run())
