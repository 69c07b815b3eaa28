"""The decode side of the KV channels: join a pair's channel, post receives in announcement
order, write arriving pages into their reservation, report transfers.

The prefill worker is rank 0 of each channel; this worker joins as rank 1 (``open_channel``).
``announce`` posts the receive for the next message on a channel before it replies, and only
a successful reply makes the prefill worker post its send, so both sides stay in order.
The transport only touches the staging buffer; the receiver thread then writes the pages
into the reservation under the record's lock (which freeing also takes) and queues the
admission on the engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import grpc
import structlog
import torch

from decode_worker.reservations import ReservationTable, TransferRecord
from engine.engine import Engine
from engine.kv_layout import KVLayout
from plumbing import convert
from plumbing.metrics import WorkerMetrics
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel, TransferState
from plumbing.transport.transfer import InvalidTransition
from splitserve.v1 import kv_transfer_pb2

log = structlog.get_logger()

STATE_TO_PROTO = {
    TransferState.PENDING: kv_transfer_pb2.TRANSFER_STATE_PENDING,
    TransferState.BOOTSTRAPPING: kv_transfer_pb2.TRANSFER_STATE_BOOTSTRAPPING,
    TransferState.TRANSFERRING: kv_transfer_pb2.TRANSFER_STATE_TRANSFERRING,
    TransferState.DONE: kv_transfer_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: kv_transfer_pb2.TRANSFER_STATE_FAILED,
}


class KVInbox:
    """Channels joined by this worker and the receives posted on them."""

    def __init__(self, engine: Engine, table: ReservationTable, device: str, metrics: WorkerMetrics,
                 on_engine_thread: Callable[[Callable[[Engine], None]], object]) -> None:
        self._engine = engine  # unpack_kv only (thread-safe under the record lock)
        self._table = table
        self._device = device
        self._metrics = metrics
        self._on_engine_thread = on_engine_thread
        self.layout: KVLayout = engine.kv_layout
        self.channels: dict[int, KVChannel] = {}
        self._channel_ids = itertools.count(1)

    async def open_channel(self, request: kv_transfer_pb2.KVChannelHandshake) -> kv_transfer_pb2.KVChannelAccept:
        try:
            self.layout.check_compatible(convert.kv_layout_from_proto(request.kv_layout))
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"kv_layout: {exc}") from None
        timeout_s = max(request.timeout_ms, 1) / 1000.0
        channel = await asyncio.get_running_loop().run_in_executor(None, self._join, request, timeout_s)
        channel_id = next(self._channel_ids)
        self.channels[channel_id] = channel
        log.info("kv.channel_open", channel_id=channel_id, transport=channel.kind.value,
                 prefill_worker_id=request.prefill_worker_id)
        return kv_transfer_pb2.KVChannelAccept(channel_id=channel_id)

    def _join(self, request: kv_transfer_pb2.KVChannelHandshake, timeout_s: float) -> KVChannel:
        if request.transport == kv_transfer_pb2.TRANSPORT_KIND_GLOO:
            from plumbing.transport.gloo import connect_gloo

            return connect_gloo(request.gloo.host, request.gloo.port, timeout_s=timeout_s)
        if request.transport == kv_transfer_pb2.TRANSPORT_KIND_NCCL:
            from plumbing.transport.nccl import NcclChannel

            if len(request.nccl_unique_id) != 128:
                raise ValueError(f"nccl_unique_id must be 128 bytes, got {len(request.nccl_unique_id)}")
            return NcclChannel(request.nccl_unique_id, rank=1, device=torch.device(self._device),
                               timeout_s=timeout_s)
        raise ValueError(f"transport: unknown transport kind {request.transport}")

    def announce(self, header: kv_transfer_pb2.TransferHeader) -> kv_transfer_pb2.TransferAck:
        """Post the receive for the next message on the header's channel."""
        channel = self.channels.get(header.channel_id)
        if channel is None or channel.broken:
            self.channels.pop(header.channel_id, None)
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"channel_id {header.channel_id} is not open here")
        record = self._table.pending.get(header.transfer_id)
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"transfer_id {header.transfer_id} has no live reservation")
        if header.num_blocks != len(record.block_ids) or header.num_prompt_tokens != len(record.prompt_token_ids):
            raise ValueError(
                f"num_blocks/num_prompt_tokens {header.num_blocks}/{header.num_prompt_tokens} do not match "
                f"the reservation {len(record.block_ids)}/{len(record.prompt_token_ids)}"
            )
        try:
            record.transfer.advance(TransferState.BOOTSTRAPPING)
        except InvalidTransition:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {header.transfer_id} is {record.transfer.state.name}") from None
        record.header = header
        staging = torch.empty(self.layout.packed_shape(header.num_blocks), dtype=getattr(torch, self.layout.dtype))
        record.recv_started = time.monotonic()
        future = channel.recv(staging)
        record.transfer.advance(TransferState.TRANSFERRING)
        future.add_done_callback(lambda f: self._on_pages(record, staging, f.exception()))
        return kv_transfer_pb2.TransferAck()

    def _on_pages(self, record: TransferRecord, staging: torch.Tensor, error: BaseException | None) -> None:
        """Receiver thread: write the pages into the reservation (unless it already ended),
        mark the transfer DONE, and queue the admission on the engine thread."""
        with record.lock:
            if record.transfer.finished:
                log.info("kv.late_pages_dropped", transfer_id=record.transfer.transfer_id)
                return
            if error is None:
                try:
                    self._engine.unpack_kv(record.request_id, staging)
                except Exception as exc:  # noqa: BLE001 - reported like a failed receive
                    error = exc
            if error is None:
                record.transfer.advance(TransferState.DONE)
        if error is None:
            seconds = time.monotonic() - record.recv_started
            self._metrics.transfer_bytes.inc(staging.numel() * staging.element_size())
            self._metrics.transfer_seconds.observe(seconds)
            self._metrics.transfers.labels(role="decode", outcome="done").inc()
            self._table.resolve(record)
        self._on_engine_thread(lambda e: self._table.admit(e, record, error))

    async def await_transfer(self, request: kv_transfer_pb2.AwaitTransferRequest) -> kv_transfer_pb2.TransferStatus:
        """Wait (up to the request's timeout) until the transfer is DONE or FAILED."""
        record = self._table.recent.get(request.transfer_id)
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"transfer_id {request.transfer_id} is unknown")
        timeout = max(request.timeout_ms, 1) / 1000.0 if request.timeout_ms else None
        try:
            await asyncio.wait_for(asyncio.shield(record.done), timeout)
        except asyncio.TimeoutError:
            pass
        return kv_transfer_pb2.TransferStatus(state=STATE_TO_PROTO[record.transfer.state],
                                              error=record.transfer.error or "")

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
