"""The prefill side of the KV channels: a few lanes per decode worker, each one channel opened
lazily by a handshake and carrying one transfer at a time.

The prefill worker is rank 0: it hosts the Gloo rendezvous (or makes the NCCL unique id)
and calls ``OpenKVChannel`` on the decode worker, which joins as rank 1 and answers with a
random channel id and its incarnation. A pair has up to ``--kv-channels-per-peer`` lanes
(default 4), so a slow or large transfer never holds up the next one (no head-of-line
blocking); a transfer takes an idle lane (one whose channel is open first; a new one is
opened one at a time per pair) and keeps it, in one task shielded from the caller's
cancellation, until its last message was *sent*::

    take a lane ─▶ AnnounceTransfer ──────────────────────────▶ reply (decode posted its receives)
                 └▶ pack chunk 0, send; pack chunk 1, send; …  (not waiting for the reply)
                    last send done ─▶ the lane is free again

The sends are posted without waiting for the announcement's reply (one round trip fewer);
that keeps the order both ranks must agree on (NCCL has no tags) because a lane carries one
transfer at a time: the decode worker's next receives on that channel are this transfer's or
none. Should the announcement be refused (or fail), the lane's channel is dropped, which
fails the posted sends at once on both sides and touches no other transfer; the lane opens a
new channel when next used. A channel is used only with the decode incarnation it was opened
with: a transfer whose target (``DecodeTarget.incarnation``) is another incarnation reopens
it first, so a channel to a dead process is never kept just because no transfer failed on it.
Every send is framed with its transfer's tag (``plumbing.identity.frame_tag``).

A handshake with a peer that fails (its join timed out or was refused) puts that peer in
back-off (``JOIN_BACKOFF_S`` doubling up to ``MAX_JOIN_BACKOFF_S``): its transfers fail at once
with UNAVAILABLE until then, and the gateway retries elsewhere or prefills locally; other
peers are not affected. An internal deadline (the handshake's or the announce's) is reported
as UNAVAILABLE, never as DEADLINE_EXCEEDED, which the client would take for its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from engine.kv_layout import KVLayout
from plumbing import tracing
from plumbing.blocking import DaemonCalls
from plumbing.convert import kv_layout_to_proto
from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel, TransportUnavailable
from plumbing.transport.pages import StagingPool, chunk_ranges, send_chunks
from splitserve_api.v1 import decode_pb2_grpc, kv_transfer_pb2

log = structlog.get_logger()
JOIN_BACKOFF_S, MAX_JOIN_BACKOFF_S = 0.5, 30.0
PackChunk = Callable[[int, int, torch.Tensor], object]  # (first page, pages, buffer to fill)


@dataclass(eq=False)
class Lane:
    """One channel of a pair; it carries one transfer at a time (``busy``)."""

    index: int
    channel: KVChannel | None = None
    channel_id: int = 0
    incarnation: int = 0  # the decode incarnation the channel was opened with
    busy: bool = False

    def usable(self, incarnation: int) -> bool:
        return self.channel is not None and not self.channel.broken and self.incarnation == incarnation

    def drop_channel(self, address: str, reason: str) -> None:
        if self.channel is not None:
            log.info("kv.channel_dropped", peer=address, lane=self.index, channel_id=self.channel_id, reason=reason)
            self.channel.close()
        self.channel, self.channel_id, self.incarnation = None, 0, 0


@dataclass(eq=False)
class Peer:
    """A decode worker and the lanes to it."""

    address: str
    rpc_channel: PeerChannel  # gRPC to the decode worker (TLS, the shared secret, rotation)
    lanes: list[Lane]
    idle: asyncio.Semaphore  # counts lanes not busy
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)  # one handshake at a time per pair
    num_failed_opens: int = 0  # handshakes failed in a row
    retry_at: float = 0.0  # no handshake before this (time.monotonic())

    @property
    def stub(self) -> decode_pb2_grpc.DecodeWorkerStub:
        return self.rpc_channel.stub(decode_pb2_grpc.DecodeWorkerStub)

    def take(self, incarnation: int) -> Lane:
        """An idle lane (the caller holds one count of ``idle``), open ones first."""
        lane = min((lane for lane in self.lanes if not lane.busy), key=lambda lane: not lane.usable(incarnation))
        lane.busy = True
        return lane

    def give(self, lane: Lane) -> None:
        lane.busy = False
        self.idle.release()

    def drop_channels(self, reason: str) -> None:
        for lane in self.lanes:
            lane.drop_channel(self.address, reason)


class KVChannelPool:
    def __init__(self, layout: KVLayout, transport: str, host: str, device: str, timeout_s: float,
                 incarnation: int, fault_stall_s: float = 0.0, security: ChannelSecurity | None = None,
                 num_lanes: int = 4) -> None:
        if num_lanes < 1:
            raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
        self.layout = layout
        self.transport = transport
        self.host = host
        self.device = device
        self.timeout_s = timeout_s
        self.incarnation = incarnation
        self.fault_stall_s = fault_stall_s
        self.security = security or ChannelSecurity()
        self.num_lanes = num_lanes
        self.worker_id = 0  # set once registered
        self._peers: dict[str, Peer] = {}
        self._staging = StagingPool()  # send buffers, reused across transfers
        self._accepts: DaemonCalls[KVChannel] = DaemonCalls(
            "kv_channel_accept", max_running=8, max_queued=64, discard=lambda channel: channel.close())

    def peer(self, address: str) -> Peer:
        peer = self._peers.get(address)
        if peer is None:
            peer = Peer(address, PeerChannel(address, self.security), [Lane(i) for i in range(self.num_lanes)],
                        asyncio.Semaphore(self.num_lanes))
            self._peers[address] = peer
        return peer

    async def announce_and_send(self, address: str, incarnation: int, header: kv_transfer_pb2.TransferHeader,
                                pack: PackChunk, tag: int) -> float:
        """Take a lane to decode incarnation ``incarnation`` at ``address`` (opening its
        channel if needed), announce, and meanwhile pack and post the transfer's messages
        (``header.chunk_blocks`` pages each; ``pack(first_page, num_pages, buffer)`` fills
        one), framed with ``tag``; returns once the last was sent and the announcement was
        accepted: the seconds from the first send posted to the last done (the wire)."""
        peer = self.peer(address)
        await peer.idle.acquire()  # cancellable: nothing has started yet
        lane = peer.take(incarnation)
        try:
            task = asyncio.ensure_future(self._transfer(peer, lane, incarnation, header, pack, tag))
        except BaseException:
            peer.give(lane)
            raise
        task.add_done_callback(lambda t: _settled(t, peer, lane))
        return await asyncio.shield(task)

    async def _transfer(self, peer: Peer, lane: Lane, incarnation: int, header: kv_transfer_pb2.TransferHeader,
                        pack: PackChunk, tag: int) -> float:
        """On ``lane``: the channel, the announce and the sends; the lane stays taken until
        the last send is done."""
        if lane.channel is not None and not lane.usable(incarnation):
            lane.drop_channel(peer.address, "broken" if lane.channel.broken else "the decode worker restarted")
        if lane.channel is None:
            async with peer.opening:
                await self._open_or_back_off(peer, lane)
        if lane.incarnation != incarnation:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the decode worker at {peer.address} is not the incarnation that holds the reservation")
        channel = lane.channel
        assert channel is not None
        header.channel_id = lane.channel_id
        header.decode_incarnation = incarnation
        header.prefill_incarnation = self.incarnation
        announce = asyncio.ensure_future(peer.stub.AnnounceTransfer(header, timeout=self.timeout_s))
        try:
            if self.fault_stall_s:  # failure testing: the pages leave this long after the announcement
                await asyncio.shield(announce)
                await asyncio.sleep(self.fault_stall_s)
            chunks = chunk_ranges(header.num_blocks, header.chunk_blocks)
            t_wire = time.monotonic()
            with tracing.internal_span("kv.transfer.wire", {"kv.blocks": header.num_blocks,
                                                            "kv.messages": len(chunks), "kv.lane": lane.index}):
                sent = await asyncio.to_thread(send_chunks, channel, chunks, tag, self._staging,
                                               self.layout.packed_shape, getattr(torch, self.layout.dtype), pack,
                                               self._staging_device())
                await asyncio.shield(announce)
                await asyncio.wrap_future(sent)
            return time.monotonic() - t_wire
        except BaseException as exc:
            # The posted sends (if any) can only be matched by this transfer's receives: a
            # refused or failed announcement, or a failed send, ends the lane's channel.
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            lane.drop_channel(peer.address, f"transfer failed: {reason}")
            announce.cancel()
            announce.add_done_callback(lambda t: t.cancelled() or t.exception())
            if _is_deadline(exc):
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   f"KV transfer to {peer.address} timed out") from None
            raise

    async def _open_or_back_off(self, peer: Peer, lane: Lane) -> None:
        """Open ``lane``'s channel unless ``peer`` is backing off; a failure starts (or
        doubles) its back-off. Internal deadlines come out as UNAVAILABLE."""
        wait_s = peer.retry_at - time.monotonic()
        if wait_s > 0:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"KV channel to {peer.address} failed; backing off {wait_s:.1f} s more")
        try:
            await self._open(peer, lane)
        except Exception as exc:
            backoff_s = min(JOIN_BACKOFF_S * 2 ** peer.num_failed_opens, MAX_JOIN_BACKOFF_S)
            peer.num_failed_opens += 1
            peer.retry_at = time.monotonic() + backoff_s
            log.info("kv.channel_open_failed", peer=peer.address, backoff_s=backoff_s, error=type(exc).__name__)
            if _is_deadline(exc):
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   f"KV channel handshake with {peer.address} timed out") from None
            raise
        peer.num_failed_opens, peer.retry_at = 0, 0.0

    async def _open(self, peer: Peer, lane: Lane) -> None:
        handshake = kv_transfer_pb2.KVChannelHandshake(
            prefill_worker_id=self.worker_id, kv_layout=kv_layout_to_proto(self.layout),
            timeout_ms=int(self.timeout_s * 1000), prefill_incarnation=self.incarnation, lane=lane.index,
        )
        local, cleanup = self._local_side(handshake)
        local_task = asyncio.ensure_future(local)
        try:
            accept = await peer.stub.OpenKVChannel(handshake, timeout=self.timeout_s)
        except BaseException:
            cleanup()
            local_task.cancel()  # its thread ends within timeout_s; a late channel is closed
            raise
        lane.channel = await local_task
        lane.channel_id, lane.incarnation = accept.channel_id, accept.decode_incarnation
        log.info("kv.channel_open", peer=peer.address, lane=lane.index, channel_id=lane.channel_id,
                 decode_incarnation=lane.incarnation, transport=lane.channel.kind.value)

    def _local_side(self, handshake: kv_transfer_pb2.KVChannelHandshake
                    ) -> tuple[Awaitable[KVChannel], Callable[[], None]]:
        """Fill in the transport part of ``handshake``; rank 0's blocking half (on a daemon
        thread) and what undoes it if the handshake fails."""
        if self.transport == "gloo":
            from plumbing.transport.gloo import GlooRendezvous

            rendezvous = GlooRendezvous(self.host, timeout_s=self.timeout_s)
            handshake.transport = kv_transfer_pb2.TRANSPORT_KIND_GLOO
            handshake.gloo.host = rendezvous.host
            handshake.gloo.port = rendezvous.port
            return self._accepts.run(rendezvous.accept), rendezvous.close
        from plumbing.transport.nccl import NcclChannel, NcclLibrary

        if not torch.cuda.is_available():
            raise TransportUnavailable("nccl transport needs a CUDA device; none is visible")
        unique_id = NcclLibrary().get_unique_id()
        handshake.transport = kv_transfer_pb2.TRANSPORT_KIND_NCCL
        handshake.nccl_unique_id = unique_id
        device = torch.device(self.device)
        return self._accepts.run(
            lambda: NcclChannel(unique_id, rank=0, device=device, timeout_s=self.timeout_s)), lambda: None

    def _staging_device(self) -> torch.device:
        """Where the channel's tensors live: the GPU for NCCL, else the CPU."""
        return torch.device(self.device) if self.transport == "nccl" else torch.device("cpu")

    async def close(self) -> None:
        for peer in self._peers.values():
            peer.drop_channels("shutdown")
            await peer.rpc_channel.close()
        self._peers.clear()


def _is_deadline(exc: BaseException) -> bool:
    """An internal deadline: a call to the decode worker, or a wait here, that timed out."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return isinstance(exc, TimeoutError)


def _settled(task: asyncio.Task[None], peer: Peer, lane: Lane) -> None:
    """The shielded transfer task ended: free the lane, and take its outcome so nothing is
    left unretrieved when the caller had stopped waiting."""
    peer.give(lane)
    if not task.cancelled() and task.exception() is not None:
        log.debug("kv.transfer_task_failed", error=str(task.exception()))
