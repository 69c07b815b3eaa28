"""A stateful property test of the KV hand-off on the decode worker (issue #22): hypothesis
interleaves reservations, announces, pages landing or failing, lease expiry, cancels, a
prefill worker restarting (its channels replaced, their receives failed) and channel
eviction, and after every step checks that no block leaks (the engine's ``check_integrity``;
the engine's reserved blocks are exactly the live reservations'), that the table's counts
agree, that no channel with a receive posted was closed to make room, and that no
transition was invalid (no exception escaped a receive callback or a step).

The engine is real (its KV pool, 64 blocks; the model never runs: admitted sequences are
only counted and aborted); the channels are stand-ins whose receives the test completes,
playing the receiver thread; the engine thread's queue is run by the ``tick`` rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from decode_worker import kv_channels
from decode_worker.kv_inbox import KVInbox
from decode_worker.reservation import Phase, Reservation
from decode_worker.reservations import ReservationTable
from engine import Engine, EngineConfig, SamplingParams
from plumbing.metrics import WorkerMetrics
from plumbing.rpc import ServiceError
from plumbing.transport import TransportError, TransportKind
from splitserve_api.v1 import kv_transfer_pb2

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "target")
INCARNATION = 0xDEC0DE
_ENGINE: list[Engine] = []
_METRICS: list[WorkerMetrics] = []


class FakeChannel:
    """A KV channel whose receives the test completes (as the receiver thread would)."""

    kind = TransportKind.GLOO

    def __init__(self) -> None:
        self.receives: list[Future[None]] = []
        self.broken = False
        self.closed_busy = False

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> Future[None]:
        future: Future[None] = Future()
        if self.broken:
            future.set_exception(TransportError("closed"))
        else:
            self.receives.append(future)
        return future

    def close(self) -> None:
        self.closed_busy |= any(not f.done() for f in self.receives)
        self.broken = True
        for future in self.receives:
            if not future.done():
                future.set_exception(TransportError("channel closed"))


class HandOff(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        if not _ENGINE:
            _ENGINE.append(Engine(EngineConfig(model=MODEL, num_threads=1, num_kv_blocks=64)))
            _METRICS.append(WorkerMetrics.create("decode"))
        self.engine = _ENGINE[0]
        self.loop = asyncio.new_event_loop()
        self.errors: list[BaseException] = []
        self.pushed: list[BaseException] = []
        self.engine_queue: list[Callable[[Engine], None]] = []
        self.table = ReservationTable(self.loop, lambda rid, exc: self.pushed.append(exc), lambda: None, 1000)
        self.inbox = KVInbox(self.engine, self.table, "cpu", _METRICS[0], self.engine_queue.append,
                             INCARNATION, max_timeout_s=5)
        on_chunk = self.inbox._on_chunk
        self.inbox._on_chunk = lambda *a: self._guard(on_chunk, *a)  # type: ignore[method-assign]
        self.all_channels: list[FakeChannel] = []
        self.prefill_incarnation = 1
        self.lanes: dict[int, int] = {}  # lane -> channel id
        self.next_rid = 0
        for lane in range(2):
            self._open(lane)

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - checked by the invariant
            self.errors.append(exc)

    def _open(self, lane: int) -> None:
        channel = FakeChannel()
        self.all_channels.append(channel)
        try:
            self.lanes[lane] = self.inbox.channels.add(channel, self.prefill_incarnation, lane)
        except ServiceError as exc:  # every channel carries a transfer: the prefill worker tries again later
            assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc

    def _flush(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))

    @rule(target=reservations, num_blocks=st.integers(1, 24))
    def reserve(self, num_blocks: int) -> Reservation | None:
        self.next_rid += 1
        prompt = [5 + (self.next_rid + i) % 50 for i in range(num_blocks * self.engine.kv.block_size - 1)]
        rid = str(self.next_rid)
        granted = self.table.request(self.engine, rid, prompt, SamplingParams(max_tokens=2), 3600, 60)
        self._flush()
        if not granted.done():  # no room now: the stream gives up waiting
            self.table.forget(self.engine, rid, "the stream ended")
            self._flush()
        return granted.result() if granted.done() and not granted.exception() else None

    @rule(r=reservations, lane=st.integers(0, 1), chunk_blocks=st.integers(0, 3))
    def announce(self, r: Reservation | None, lane: int, chunk_blocks: int) -> None:
        if r is None:
            return
        header = kv_transfer_pb2.TransferHeader(
            channel_id=self.lanes[lane], transfer_id=r.transfer_id, transfer_secret=r.secret,
            request_id=int(r.request_id), num_blocks=r.num_fresh_blocks, num_prompt_tokens=len(r.prompt_token_ids),
            num_cached_blocks=r.num_cached_blocks, first_token_id=7, chunk_blocks=chunk_blocks,
            decode_incarnation=INCARNATION, prefill_incarnation=self.prefill_incarnation)
        try:
            self.inbox.announce(header)
        except ServiceError as exc:  # announced already, ended, or its channel was replaced
            assert exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), exc

    @rule(lane=st.integers(0, 1), ok=st.booleans())
    def page_lands(self, lane: int, ok: bool) -> None:
        for channel in self.all_channels:
            waiting = [f for f in channel.receives if not f.done()]
            if waiting:
                waiting[0].set_result(None) if ok else waiting[0].set_exception(TransportError("reset"))
                return

    @rule(r=reservations)
    def lease_expires(self, r: Reservation | None) -> None:
        if r is not None:
            r.lease_deadline = 0.0

    @rule(r=consumes(reservations))
    def stream_ends(self, r: Reservation | None) -> None:
        if r is not None:
            self.table.forget(self.engine, r.request_id, "the stream ended")

    @rule()
    def tick(self) -> None:
        queue, self.engine_queue[:] = list(self.engine_queue), []
        for fn in queue:
            fn(self.engine)
        self.table.expire_leases(self.engine)
        self.table.serve_waiters(self.engine)
        self._flush()

    @rule()
    def prefill_worker_restarts(self) -> None:
        self.prefill_incarnation += 1
        for lane in self.lanes:
            self._open(lane)

    @rule()
    def a_stranger_opens_a_channel(self) -> None:  # beyond MAX_CHANNELS: eviction
        try:
            self.next_rid += 1
            self.inbox.channels.add(FakeChannel(), 10_000 + self.next_rid, 0)
        except ServiceError as exc:
            assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    @invariant()
    def nothing_leaks_and_nothing_invalid(self) -> None:
        assert not self.errors, self.errors
        self.engine.check_integrity()
        live = self.table.pending.values()
        waiting = {r.request_id for r in self.engine.scheduler.waiting_for_remote_kvs()}
        assert waiting == {r.request_id for r in live}  # the engine's one status for a live hand-off
        assert self.engine.load().num_blocks_in_transfer == len({b for r in live for b in r.block_ids})
        assert all(r.phase is not Phase.ADMITTED for r in live)
        if not self.engine_queue:  # a failed one is freed by the engine-thread call it queued
            assert all(r.phase is not Phase.FAILED for r in live)
        assert not any(c.closed_busy for c in self.all_channels)  # eviction spared every busy channel
        assert all(isinstance(e, ServiceError) and e.code in (grpc.StatusCode.UNAVAILABLE,
                   grpc.StatusCode.INVALID_ARGUMENT) for e in self.pushed)

    def teardown(self) -> None:
        for r in list(self.table.pending.values()):
            self.table.forget(self.engine, r.request_id, "teardown")
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort(rid)
        self.inbox.close()
        self.loop.close()
        assert self.engine.num_free_blocks == self.engine.kv.num_blocks
        self.engine.check_integrity()


@pytest.fixture(autouse=True)
def _few_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_channels, "MAX_CHANNELS", 4)  # eviction within a few steps


HandOff.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
test_hand_off_lifecycle = HandOff.TestCase
