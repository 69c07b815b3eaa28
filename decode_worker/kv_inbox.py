"""The decode side of the KV channels: join a pair's channel, post receives in announcement
order, write arriving pages into their reservation, report transfers.

The prefill worker is rank 0 of each channel; this worker joins as rank 1 (``open_channel``,
guarded as ``kv_channels.py`` says). ``announce`` checks that the header addresses this
incarnation, on a channel the sender's incarnation opened, for a reservation whose secret it
presents, then posts the receives, framed with the transfer's tag, for the transfer's next
messages on that channel (``header.chunk_blocks`` pages each, ``plumbing.transport.pages``)
before it replies, and hands the first token to the request's Decode stream; only a
successful reply makes the prefill worker post its sends, so both sides stay in order, and a
send made for any other transfer fails the receive (and breaks the channel) instead of
filling this reservation. Only the reservation's fresh blocks receive pages: its leading
prefix-cache hits (``num_cached_blocks``) are already here.
The transport only touches staging buffers (reused, ``StagingPool``); the receiver thread
writes each message's pages into the reservation as it lands, under the reservation's lock
(which freeing also takes: ``reservation.py``), while later messages are still on the wire, and after the last
queues the admission on the engine thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog
import torch

from decode_worker import kv_channels
from decode_worker.kv_channels import ChannelTable
from decode_worker.reservation import InvalidTransition, Reservation
from decode_worker.reservations import ReservationTable
from engine.engine import Engine
from engine.kv_layout import KVLayout
from plumbing import convert
from plumbing.metrics import WorkerMetrics
from plumbing.rpc import ServiceError
from plumbing.transport import KVChannel, TransportKind
from plumbing.transport.pages import StagingPool, chunk_ranges
from splitserve_api.v1 import kv_transfer_pb2

log = structlog.get_logger()
MAX_MESSAGES = 1024  # messages one transfer may take (TransferHeader.chunk_blocks)
# One answer for an unknown transfer id and a wrong secret: nothing tells which ids exist.
_NO_SUCH_TRANSFER = "transfer_id and transfer_secret name no live transfer here"


class KVInbox:
    """Channels joined by this worker and the receives posted on them."""

    def __init__(self, engine: Engine, table: ReservationTable, device: str, metrics: WorkerMetrics,
                 on_engine_thread: Callable[[Callable[[Engine], None]], object], incarnation: int,
                 max_timeout_s: float, on_announced: Callable[[Reservation], None] = lambda reservation: None) -> None:
        self._engine = engine  # unpack_kv only (thread-safe under the reservation's lock)
        self._table = table
        self._device = device
        self._metrics = metrics
        self._on_engine_thread = on_engine_thread
        self._incarnation = incarnation
        self._on_announced = on_announced  # the first token goes to the Decode stream
        self._staging = StagingPool()
        self.receive_us: dict[str, int] = {}  # request id -> announce to last page written (the stream pops it)
        self.layout: KVLayout = engine.kv_layout
        self.channels = ChannelTable()
        self.joins = kv_channels.Joins(device, max_timeout_s)

    async def open_channel(self, request: kv_transfer_pb2.KVChannelHandshake,
                           caller: str | None) -> kv_transfer_pb2.KVChannelAccept:
        """Join the channel the handshake describes, dialing only the caller's own address."""
        try:
            self.layout.check_compatible(convert.kv_layout_from_proto(request.kv_layout))
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"kv_layout: {exc}") from None
        if not request.prefill_incarnation:
            raise ValueError("prefill_incarnation must be set (the prefill worker's incarnation)")
        channel = await self.joins.join(request, caller)
        channel_id = self.channels.add(channel, request.prefill_incarnation, request.lane)
        log.info("kv.channel_open", channel_id=channel_id, transport=channel.kind.value,
                 prefill_worker_id=request.prefill_worker_id, prefill_incarnation=request.prefill_incarnation)
        return kv_transfer_pb2.KVChannelAccept(channel_id=channel_id, decode_incarnation=self._incarnation)

    def announce(self, header: kv_transfer_pb2.TransferHeader) -> kv_transfer_pb2.TransferAck:
        """Check the header, then post the receive for the next message on its channel."""
        if header.decode_incarnation != self._incarnation:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "decode_incarnation: the decode worker addressed is not this process")
        channel = self.channels.get(header.channel_id, header.prefill_incarnation)
        if channel is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "channel_id is not open here for this prefill_incarnation")
        reservation = self._table.lookup(header.transfer_id, header.transfer_secret)
        if reservation is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, _NO_SUCH_TRANSFER)
        if (str(header.request_id) != reservation.request_id
                or header.num_prompt_tokens != len(reservation.prompt_token_ids)
                or header.num_cached_blocks != reservation.num_cached_blocks
                or header.num_blocks != reservation.num_fresh_blocks):
            raise ValueError("request_id, num_prompt_tokens, num_cached_blocks and num_blocks must be the "
                             "reservation's (num_blocks: the blocks after its num_cached_blocks)")
        chunks = chunk_ranges(header.num_blocks, header.chunk_blocks)
        if len(chunks) > MAX_MESSAGES:
            raise ValueError(f"chunk_blocks: a transfer may be at most {MAX_MESSAGES} messages")
        try:
            reservation.start_receiving(header, len(chunks))
        except InvalidTransition:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "transfer_id was announced already or has ended") from None
        self._post_receives(reservation, channel, header.channel_id, chunks)
        self._on_announced(reservation)
        return kv_transfer_pb2.TransferAck()

    def _post_receives(self, reservation: Reservation, channel: KVChannel, channel_id: int,
                       chunks: list[tuple[int, int]]) -> None:
        """Every message of the transfer posted now, in order, each into a staging buffer
        (the channel counts them as in flight until they complete)."""
        dtype = getattr(torch, self.layout.dtype)
        device = torch.device(self._device) if channel.kind == TransportKind.NCCL else torch.device("cpu")
        self.channels.receiving(channel_id, len(chunks))
        for start, num in chunks:
            staging = self._staging.take(self.layout.packed_shape(num), dtype, device)
            future = channel.recv(staging, tag=reservation.tag)
            future.add_done_callback(
                lambda f, s=start, b=staging: self._on_chunk(reservation, channel_id, s, b, f.exception()))

    def _on_chunk(self, reservation: Reservation, channel_id: int, first_page: int, staging: torch.Tensor,
                  error: BaseException | None) -> None:
        """Receiver thread: write one message's pages into the reservation while it is
        RECEIVING; after the last (RECEIVED) or the first failure (FAILED), queue the
        admission (or the freeing) on the engine thread."""
        self.channels.receiving(channel_id, -1)
        last: bool | None = None
        if error is None:
            try:
                last = reservation.write_chunk(
                    lambda: self._engine.handoff.unpack_kv(reservation.request_id, staging, first_page=first_page))
            except Exception:  # noqa: BLE001 - the reservation failed with the reason
                last = True
            else:
                self._staging.give(staging)
        elif reservation.fail(f"{error}"):
            last = True
        if last is None:
            log.debug("kv.late_pages_dropped", transfer_id=reservation.transfer_id)
        if not last:
            return
        if reservation.error is None:
            seconds = time.monotonic() - reservation.recv_started
            self.receive_us[reservation.request_id] = int(seconds * 1e6)
            self._metrics.transfer_bytes.inc(reservation.num_fresh_blocks * self.layout.bytes_per_block)
            self._metrics.transfer_seconds.observe(seconds)
            self._metrics.transfers.labels(role="decode", outcome="done").inc()
        self._on_engine_thread(lambda e: self._table.admit(e, reservation))

    def close(self) -> None:
        self.channels.close()
