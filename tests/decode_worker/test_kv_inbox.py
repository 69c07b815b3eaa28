"""The decode worker's KV inbox (issue #10, item 2): a transfer's pages can be written only into
the reservation its transfer id names, on the channel it was announced on.

The issue's reproduction: a stale sender's send matched a receive posted for another
request, and that request's reply continued a different user's prompt. Here a receive is
posted for transfer A and the peer sends the pages it packed for transfer B on that channel:
A fails, the channel breaks, no block of A (or B) is written, and B is untouched. Real engine,
real Gloo pair on 127.0.0.1, the inbox and reservation table of the service.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from decode_worker.kv_inbox import KVInbox
from decode_worker.reservation import Phase, Reservation
from decode_worker.reservations import ReservationTable
from engine import Engine, EngineConfig, SamplingParams
from plumbing.identity import frame_tag
from plumbing.metrics import WorkerMetrics
from plumbing.rpc import ServiceError
from plumbing.transport.gloo import GlooChannel, GlooRendezvous, connect_gloo
from splitserve_api.v1 import kv_transfer_pb2

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "target")
INCARNATION, PREFILL_INCARNATION = 0xDEC0DE, 0xF111


def _pair() -> tuple[GlooChannel, GlooChannel]:
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=10)
    joined: dict[str, GlooChannel] = {}
    thread = threading.Thread(target=lambda: joined.update(c=connect_gloo("127.0.0.1", rendezvous.port, 10)))
    thread.start()
    sender = rendezvous.accept()
    thread.join()
    return sender, joined["c"]


class Harness:
    """A decode worker's inbox on the test's event loop (which plays the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = Engine(EngineConfig(model=MODEL, num_threads=1, num_kv_blocks=64))
        self.pushed: dict[str, BaseException] = {}
        self.table = ReservationTable(loop, lambda rid, exc: self.pushed.update({rid: exc}), lambda: None,
                                      max_per_request=2)
        on_engine: Callable[[Callable[[Engine], None]], None] = (
            lambda fn: loop.call_soon_threadsafe(fn, self.engine))
        self.inbox = KVInbox(self.engine, self.table, "cpu", WorkerMetrics.create("decode"), on_engine,
                             INCARNATION, max_timeout_s=10)

    async def reserve(self, rid: str, num_tokens: int) -> Reservation:
        prompt = list(range(5, 5 + num_tokens))
        granted = self.table.request(self.engine, rid, prompt, SamplingParams(max_tokens=4), 30.0, 1.0)
        record = await granted
        assert record is not None
        return record

    def header(self, record: Reservation, channel_id: int, secret: bytes | None = None
               ) -> kv_transfer_pb2.TransferHeader:
        return kv_transfer_pb2.TransferHeader(
            channel_id=channel_id, transfer_id=record.transfer_id,
            transfer_secret=record.secret if secret is None else secret, request_id=int(record.request_id),
            num_blocks=len(record.block_ids), num_bytes=0, num_prompt_tokens=len(record.prompt_token_ids),
            first_token_id=7, decode_incarnation=INCARNATION, prefill_incarnation=PREFILL_INCARNATION)

    def pages(self, record: Reservation) -> torch.Tensor:
        return self.engine.handoff.pack_kv(record.block_ids)


async def until_phase(record: Reservation, *phases: Phase, timeout_s: float = 10.0) -> Phase:
    """Poll (bounded) until ``record`` is in one of ``phases``; then let the loop run the
    callbacks queued for the engine thread (the loop plays it here)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while record.phase not in phases:
        assert asyncio.get_running_loop().time() < deadline, f"still {record.phase}"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    return record.phase


def _pages_like(harness: Harness, record: Reservation, value: float) -> torch.Tensor:
    return torch.full(harness.inbox.layout.packed_shape(len(record.block_ids)), value)


def test_pages_sent_for_another_transfer_never_land_and_fail_only_the_posted_one() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        sender, receiver = _pair()
        channel_id = h.inbox.channels.add(receiver, PREFILL_INCARNATION)
        a, b = await h.reserve("101", 40), await h.reserve("202", 40)
        before_a, before_b = h.pages(a).clone(), h.pages(b).clone()
        h.inbox.announce(h.header(a, channel_id))
        # The misrouted sender: B's pages (and B's tag) on the receive posted for A.
        sent = sender.send(_pages_like(h, b, 3.0), tag=frame_tag(b.transfer_id, b.secret))
        with pytest.raises(Exception, match="tag mismatch"):
            await asyncio.wait_for(asyncio.wrap_future(sent), 10)
        await until_phase(a, Phase.FAILED)
        assert a.transfer_id not in h.table.pending and receiver.broken  # freed by the table
        assert isinstance(h.pushed["101"], ServiceError) and h.pushed["101"].code == grpc.StatusCode.UNAVAILABLE
        assert "202" not in h.pushed and b.phase is Phase.RESERVED  # B untouched
        assert torch.equal(h.pages(b), before_b)
        assert torch.equal(h.pages(a), before_a)  # A's blocks never written
        # The right sender, on a fresh channel, for B: the pages land in B's blocks.
        sender2, receiver2 = _pair()
        channel2 = h.inbox.channels.add(receiver2, PREFILL_INCARNATION)  # replaces the broken one
        h.inbox.announce(h.header(b, channel2))
        await asyncio.wrap_future(sender2.send(_pages_like(h, b, 2.0), tag=frame_tag(b.transfer_id, b.secret)))
        assert await until_phase(b, Phase.ADMITTED, Phase.FAILED) is Phase.ADMITTED
        assert torch.equal(h.pages(b), _pages_like(h, b, 2.0))
        h.engine.abort("202")
        h.engine.check_integrity()
        for channel in (sender, receiver, sender2, receiver2):
            channel.close()

    asyncio.run(run())


def test_an_announce_must_present_the_secret_and_address_this_incarnation_and_channel() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        sender, receiver = _pair()
        channel_id = h.inbox.channels.add(receiver, PREFILL_INCARNATION)
        a = await h.reserve("303", 20)
        errors = []
        for header in (h.header(a, channel_id, secret=bytes(16)),  # wrong secret
                       kv_transfer_pb2.TransferHeader(  # an id that does not exist
                           channel_id=channel_id, transfer_id=a.transfer_id ^ 1,
                           transfer_secret=a.secret, decode_incarnation=INCARNATION,
                           prefill_incarnation=PREFILL_INCARNATION)):
            with pytest.raises(ServiceError) as info:
                h.inbox.announce(header)
            errors.append((info.value.code, info.value.message))
        assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.NOT_FOUND  # nothing told apart
        stale = h.header(a, channel_id)
        stale.decode_incarnation = INCARNATION + 1  # addressed to this worker's predecessor
        other_sender = h.header(a, channel_id)
        other_sender.prefill_incarnation = PREFILL_INCARNATION + 1  # not who opened the channel
        unknown_channel = h.header(a, channel_id ^ 1)
        for header in (stale, other_sender, unknown_channel):
            with pytest.raises(ServiceError) as info:
                h.inbox.announce(header)
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        mismatch = h.header(a, channel_id)
        mismatch.num_blocks += 1
        with pytest.raises(ValueError, match="reservation's") as value_error:
            h.inbox.announce(mismatch)
        assert str(len(a.block_ids)) not in str(value_error.value)  # reveals no reservation sizes
        assert a.phase is Phase.RESERVED  # nothing was posted for any of these
        h.engine.abort("303")
        h.engine.check_integrity()
        sender.close()
        receiver.close()

    asyncio.run(run())


def test_one_request_id_cannot_renew_its_reservation_without_end() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        for _ in range(2):  # max_per_request=2
            record = await h.reserve("404", 20)
            h.table.forget(h.engine, "404", "the stream ended")
            assert record.phase is Phase.FAILED and not h.table.pending
        with pytest.raises(ServiceError) as info:
            await h.reserve("404", 20)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(ValueError, match="max_model_len"):  # never more than max_model_len allows
            await h.reserve("405", 10_000)
        await h.reserve("406", 20)  # the queue is not stuck behind the refused one
        h.engine.abort("406")
        h.engine.check_integrity()

    asyncio.run(run())
