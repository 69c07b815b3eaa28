"""The prefill side's lanes (issue #13): several transfers in flight to one decode worker, each
on its own channel, their sends posted before the announcement's reply; a refused
announcement drops only its lane's channel. Real Gloo pairs on 127.0.0.1; the decode side is a
stand-in that joins channels and posts (or refuses) the announced receives."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
import torch

import prefill_worker.kv_channels as channels_module
from engine.kv_layout import KVLayout
from plumbing.transport.gloo import connect_gloo
from plumbing.transport.pages import StagingPool, chunk_ranges, recv_chunks
from prefill_worker.kv_channels import KVChannelPool
from splitserve_api.v1 import kv_transfer_pb2

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
DECODE_INCARNATION = 77
GUARD_S = 30.0


class Refused(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such transfer")


class FakeDecode:
    """OpenKVChannel and AnnounceTransfer as the decode worker answers them (no checks)."""

    def __init__(self) -> None:
        self.channels: dict[int, object] = {}
        self.ids = itertools.count(1)
        self.hold: dict[int, asyncio.Event] = {}  # transfer id -> released before the reply
        self.refuse: set[int] = set()
        self.received: dict[int, torch.Tensor] = {}
        self.done: dict[int, object] = {}

    async def OpenKVChannel(self, handshake, timeout=None):  # noqa: ANN001, ANN201, N802
        channel = await asyncio.to_thread(connect_gloo, handshake.gloo.host, handshake.gloo.port, 10.0)
        channel_id = next(self.ids)
        self.channels[channel_id] = channel
        return kv_transfer_pb2.KVChannelAccept(channel_id=channel_id, decode_incarnation=DECODE_INCARNATION)

    async def AnnounceTransfer(self, header, timeout=None):  # noqa: ANN001, ANN201, N802
        tid = header.transfer_id
        if tid in self.hold:
            await self.hold[tid].wait()
        if tid in self.refuse:
            raise Refused()
        out = torch.empty(LAYOUT.packed_shape(header.num_blocks))
        self.received[tid] = out
        self.done[tid] = recv_chunks(
            self.channels[header.channel_id], chunk_ranges(header.num_blocks, header.chunk_blocks), tid,
            StagingPool(), LAYOUT.packed_shape, torch.float32,
            lambda start, buf: out[:, :, start:start + buf.shape[2]].copy_(buf))
        return kv_transfer_pb2.TransferAck()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDecode:
    decode = FakeDecode()
    monkeypatch.setattr(channels_module.Peer, "stub", property(lambda self: decode))
    yield decode
    for channel in decode.channels.values():
        channel.close()


def _header(tid: int, num_blocks: int) -> kv_transfer_pb2.TransferHeader:
    return kv_transfer_pb2.TransferHeader(transfer_id=tid, num_blocks=num_blocks, chunk_blocks=2)


def _pages(tid: int, num_blocks: int) -> torch.Tensor:
    return torch.full(LAYOUT.packed_shape(num_blocks), float(tid))


def _send(pool: KVChannelPool, tid: int, num_blocks: int) -> asyncio.Future[float]:
    pages = _pages(tid, num_blocks)
    return asyncio.ensure_future(pool.announce_and_send(
        "decode:1", DECODE_INCARNATION, _header(tid, num_blocks),
        lambda start, n, out: out.copy_(pages[:, :, start:start + n]), tid))


def test_a_held_transfer_does_not_block_the_next_one(fake: FakeDecode) -> None:
    async def main() -> None:
        pool = KVChannelPool(LAYOUT, "gloo", "127.0.0.1", "cpu", 10.0, incarnation=5, num_lanes=2)
        fake.hold[1] = asyncio.Event()
        first = _send(pool, 1, 5)  # its announcement is not answered yet; its sends are posted
        await asyncio.wait_for(_send(pool, 2, 3), GUARD_S)  # the other lane carries this one meanwhile
        await asyncio.wait_for(asyncio.wrap_future(fake.done[2]), GUARD_S)
        assert not first.done()
        assert torch.equal(fake.received[2], _pages(2, 3))
        fake.hold[1].set()
        await asyncio.wait_for(first, GUARD_S)
        await asyncio.wait_for(asyncio.wrap_future(fake.done[1]), GUARD_S)
        assert torch.equal(fake.received[1], _pages(1, 5))
        assert len(fake.channels) == 2
        await pool.close()

    asyncio.run(main())


def test_a_refused_announcement_drops_only_its_lane(fake: FakeDecode) -> None:
    async def main() -> None:
        pool = KVChannelPool(LAYOUT, "gloo", "127.0.0.1", "cpu", 10.0, incarnation=5, num_lanes=2)
        await asyncio.wait_for(_send(pool, 1, 4), GUARD_S)
        fake.hold[2], fake.refuse = asyncio.Event(), {2}
        refused = _send(pool, 2, 4)  # posted its sends, then refused
        await asyncio.sleep(0)
        await asyncio.wait_for(_send(pool, 3, 4), GUARD_S)  # on the other lane, unaffected
        fake.hold[2].set()
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(refused, GUARD_S)
        # Two at once: both lanes carry transfers again, the dropped one on a new channel.
        await asyncio.wait_for(asyncio.gather(_send(pool, 4, 4), _send(pool, 5, 4)), GUARD_S)
        for tid in (4, 5):
            await asyncio.wait_for(asyncio.wrap_future(fake.done[tid]), GUARD_S)
            assert torch.equal(fake.received[tid], _pages(tid, 4))
        assert len(fake.channels) == 3  # two lanes, one of them reopened
        await pool.close()

    asyncio.run(main())
