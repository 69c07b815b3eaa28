"""The prefill side of the KV channels: one per decode worker, opened lazily by a handshake.

The prefill worker is rank 0: it hosts the Gloo rendezvous (or makes the NCCL unique id)
and calls ``OpenKVChannel`` on the decode worker, which joins as rank 1. Sends must be
posted in the order the decode worker posted its receives, so ``announce_and_send`` holds
the pair's lock from ``AnnounceTransfer`` until the send is queued on the channel's single
sender thread, and is shielded from cancellation in between.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from engine.kv_layout import KVLayout
from plumbing.transport import KVChannel, TransportUnavailable
from plumbing.convert import kv_layout_to_proto
from plumbing.rpc import channel_options
from splitserve.v1 import decode_pb2_grpc, kv_transfer_pb2

log = structlog.get_logger()


@dataclass
class Peer:
    """A decode worker and the open channel to it."""

    address: str
    stub: decode_pb2_grpc.DecodeWorkerStub
    grpc_channel: grpc.aio.Channel
    channel: KVChannel | None = None
    channel_id: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ChannelPool:
    def __init__(self, layout: KVLayout, transport: str, host: str, device: str, timeout_s: float,
                 fault_stall_s: float = 0.0) -> None:
        self.layout = layout
        self.transport = transport
        self.host = host
        self.device = device
        self.timeout_s = timeout_s
        self.fault_stall_s = fault_stall_s
        self.worker_id = 0  # set once registered
        self._peers: dict[str, Peer] = {}

    def peer(self, address: str) -> Peer:
        peer = self._peers.get(address)
        if peer is None:
            grpc_channel = grpc.aio.insecure_channel(address, options=channel_options())
            peer = Peer(address, decode_pb2_grpc.DecodeWorkerStub(grpc_channel), grpc_channel)
            self._peers[address] = peer
        return peer

    async def announce_and_send(
        self, address: str, header: kv_transfer_pb2.TransferHeader, packed: torch.Tensor
    ) -> Future[None]:
        """Open the channel if needed, announce, post the send; returns the send's future."""
        peer = self.peer(address)
        async with peer.lock:
            if peer.channel is None or peer.channel.broken:
                await self._open(peer)
            assert peer.channel is not None
            header.channel_id = peer.channel_id
            return await asyncio.shield(self._announce_then_post(peer, peer.channel, header, packed))

    async def _announce_then_post(
        self, peer: Peer, channel: KVChannel, header: kv_transfer_pb2.TransferHeader, packed: torch.Tensor
    ) -> Future[None]:
        await peer.stub.AnnounceTransfer(header, timeout=self.timeout_s)
        if self.fault_stall_s:
            await asyncio.sleep(self.fault_stall_s)
        return channel.send(packed)

    async def _open(self, peer: Peer) -> None:
        if peer.channel is not None:
            peer.channel.close()
            peer.channel = None
        loop = asyncio.get_running_loop()
        handshake = kv_transfer_pb2.KVChannelHandshake(
            prefill_worker_id=self.worker_id, kv_layout=kv_layout_to_proto(self.layout),
            timeout_ms=int(self.timeout_s * 1000),
        )
        if self.transport == "gloo":
            from plumbing.transport.gloo import GlooRendezvous

            rendezvous = GlooRendezvous(self.host, timeout_s=self.timeout_s)
            handshake.transport = kv_transfer_pb2.TRANSPORT_KIND_GLOO
            handshake.gloo.host = rendezvous.host
            handshake.gloo.port = rendezvous.port
            local = loop.run_in_executor(None, rendezvous.accept)
            cleanup = rendezvous.close
        else:
            from plumbing.transport.nccl import NcclChannel, NcclLibrary

            if not torch.cuda.is_available():
                raise TransportUnavailable("nccl transport needs a CUDA device; none is visible")
            unique_id = NcclLibrary().get_unique_id()
            handshake.transport = kv_transfer_pb2.TRANSPORT_KIND_NCCL
            handshake.nccl_unique_id = unique_id
            local = loop.run_in_executor(
                None, lambda: NcclChannel(unique_id, rank=0, device=torch.device(self.device),
                                          timeout_s=self.timeout_s)
            )
            cleanup = None
        try:
            accept = await peer.stub.OpenKVChannel(handshake, timeout=self.timeout_s)
        except BaseException:
            if cleanup is not None:
                cleanup()  # unblocks accept()
            local.cancel()
            raise
        peer.channel = await local
        peer.channel_id = accept.channel_id
        log.info("kv.channel_open", peer=peer.address, channel_id=peer.channel_id,
                 transport=peer.channel.kind.value)

    async def close(self) -> None:
        for peer in self._peers.values():
            if peer.channel is not None:
                peer.channel.close()
            await peer.grpc_channel.close()
        self._peers.clear()
