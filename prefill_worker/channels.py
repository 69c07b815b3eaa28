"""The prefill side of the KV channels: one per decode worker, opened lazily by a handshake.

The prefill worker is rank 0: it hosts the Gloo rendezvous (or makes the NCCL unique id)
and calls ``OpenKVChannel`` on the decode worker, which joins as rank 1 and answers with a
random channel id and its incarnation. Sends must be posted in the order the decode worker
posted its receives, so ``announce_and_send`` holds the pair's lock from ``AnnounceTransfer``
until the transfer's last message is packed and queued on the channel's single sender
thread (``plumbing.transport.pages.send_chunks``: each message is packed while the previous
ones are on the wire), in one task shielded from the caller's cancellation (the lock is
released when that task ends, never before).

A channel is used only with the decode incarnation it was opened with: a transfer whose
target (``DecodeTarget.incarnation``) is another incarnation reopens it first, so a channel
to a dead process is never kept just because no transfer failed on it. A refused or failed
announce drops the channel too (except when only the reservation was refused: NOT_FOUND or
INVALID_ARGUMENT, which the decode worker answers before it posts anything). Every send is
framed with its transfer's tag (``plumbing.identity.frame_tag``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from engine.kv_layout import KVLayout
from plumbing.blocking import DaemonCalls
from plumbing.convert import kv_layout_to_proto
from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel, TransportUnavailable
from plumbing.transport.pages import StagingPool, chunk_ranges, send_chunks
from splitserve.v1 import decode_pb2_grpc, kv_transfer_pb2

log = structlog.get_logger()
PackChunk = Callable[[int, int, torch.Tensor], object]  # (first page, pages, buffer to fill)
# The decode worker refused the transfer before posting a receive: the channel is in order.
_CHANNEL_STILL_IN_ORDER = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


@dataclass
class Peer:
    """A decode worker and the open channel to it."""

    address: str
    rpc_channel: PeerChannel  # gRPC to the decode worker (TLS, the shared secret, rotation)
    channel: KVChannel | None = None
    channel_id: int = 0
    incarnation: int = 0  # the decode incarnation the channel was opened with
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def stub(self) -> decode_pb2_grpc.DecodeWorkerStub:
        return self.rpc_channel.stub(decode_pb2_grpc.DecodeWorkerStub)

    def drop_channel(self, reason: str) -> None:
        if self.channel is not None:
            log.info("kv.channel_dropped", peer=self.address, channel_id=self.channel_id, reason=reason)
            self.channel.close()
        self.channel, self.channel_id, self.incarnation = None, 0, 0


class ChannelPool:
    def __init__(self, layout: KVLayout, transport: str, host: str, device: str, timeout_s: float,
                 incarnation: int, fault_stall_s: float = 0.0, security: ChannelSecurity | None = None) -> None:
        self.layout = layout
        self.transport = transport
        self.host = host
        self.device = device
        self.timeout_s = timeout_s
        self.incarnation = incarnation
        self.fault_stall_s = fault_stall_s
        self.security = security or ChannelSecurity()
        self.worker_id = 0  # set once registered
        self._peers: dict[str, Peer] = {}
        self._staging = StagingPool()  # send buffers, reused across transfers
        self._accepts: DaemonCalls[KVChannel] = DaemonCalls(
            "kv_channel_accept", max_running=8, max_queued=64, discard=lambda channel: channel.close())

    def peer(self, address: str) -> Peer:
        peer = self._peers.get(address)
        if peer is None:
            peer = Peer(address, PeerChannel(address, self.security))
            self._peers[address] = peer
        return peer

    async def announce_and_send(self, address: str, incarnation: int, header: kv_transfer_pb2.TransferHeader,
                                pack: PackChunk, tag: int) -> Future[None]:
        """Open (or reopen) the channel to decode incarnation ``incarnation`` at ``address``,
        announce, then pack and post the transfer's messages (``header.chunk_blocks`` pages
        each; ``pack(first_page, num_pages, buffer)`` fills one), framed with ``tag``;
        returns the last send's future."""
        peer = self.peer(address)
        await peer.lock.acquire()  # cancellable: nothing has started yet
        try:
            task = asyncio.ensure_future(self._open_announce_post(peer, incarnation, header, pack, tag))
        except BaseException:
            peer.lock.release()
            raise
        task.add_done_callback(lambda t: _settled(t, peer.lock))
        return await asyncio.shield(task)

    async def _open_announce_post(self, peer: Peer, incarnation: int, header: kv_transfer_pb2.TransferHeader,
                                  pack: PackChunk, tag: int) -> Future[None]:
        """Under the pair's lock: the channel, the announce, the send queued (in that order)."""
        if peer.channel is not None and (peer.channel.broken or peer.incarnation != incarnation):
            peer.drop_channel("broken" if peer.channel.broken else "the decode worker restarted")
        if peer.channel is None:
            await self._open(peer)
        if peer.incarnation != incarnation:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the decode worker at {peer.address} is not the incarnation that holds the reservation")
        assert peer.channel is not None
        header.channel_id = peer.channel_id
        header.decode_incarnation = incarnation
        header.prefill_incarnation = self.incarnation
        try:
            await peer.stub.AnnounceTransfer(header, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _CHANNEL_STILL_IN_ORDER:
                peer.drop_channel(f"announce failed: {exc.code().name}")
            raise
        if self.fault_stall_s:
            await asyncio.sleep(self.fault_stall_s)
        chunks = chunk_ranges(header.num_blocks, header.chunk_blocks)
        return await asyncio.to_thread(send_chunks, peer.channel, chunks, tag, self._staging,
                                       self.layout.packed_shape, getattr(torch, self.layout.dtype), pack)

    async def _open(self, peer: Peer) -> None:
        handshake = kv_transfer_pb2.KVChannelHandshake(
            prefill_worker_id=self.worker_id, kv_layout=kv_layout_to_proto(self.layout),
            timeout_ms=int(self.timeout_s * 1000), prefill_incarnation=self.incarnation,
        )
        local, cleanup = self._local_side(handshake)
        local_task = asyncio.ensure_future(local)
        try:
            accept = await peer.stub.OpenKVChannel(handshake, timeout=self.timeout_s)
        except BaseException:
            cleanup()
            local_task.cancel()  # its thread ends within timeout_s; a late channel is closed
            raise
        peer.channel = await local_task
        peer.channel_id, peer.incarnation = accept.channel_id, accept.decode_incarnation
        log.info("kv.channel_open", peer=peer.address, channel_id=peer.channel_id,
                 decode_incarnation=peer.incarnation, transport=peer.channel.kind.value)

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

    async def close(self) -> None:
        for peer in self._peers.values():
            peer.drop_channel("shutdown")
            await peer.rpc_channel.close()
        self._peers.clear()


def _settled(task: asyncio.Task[Future[None]], lock: asyncio.Lock) -> None:
    """The shielded transfer task ended: free the pair, and take its outcome so nothing is
    left unretrieved when the caller had stopped waiting."""
    lock.release()
    if not task.cancelled() and task.exception() is not None:
        log.debug("kv.transfer_task_failed", error=str(task.exception()))
