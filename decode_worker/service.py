"""The decode worker's gRPC service.

Remote prefill, as seen from here::

    gateway ──Decode──▶ reserve blocks (wait ≤ reservation_wait_ms) ──▶ stream: Reservation
    prefill ──OpenKVChannel──▶ join the pair's channel (once per pair; layout checked)
    prefill ──AnnounceTransfer──▶ post recv into a staging buffer (announcement order)
              recv done ──▶ engine thread: unpack into the reserved blocks, admit ──▶ DONE
    prefill ──AwaitTransfer──▶ returns DONE / FAILED (the prefill worker then frees its blocks)
    engine steps ──▶ stream: TokenChunk … DecodeFinished

Ownership: a reservation's blocks belong to the engine (``reserve_kv``); the table of
pending reservations lives on the engine thread, which is also where leases expire and
where the received pages are admitted, so expiry and admission cannot race. The transport
only ever touches the staging buffer, never a block: a lease may expire while a receive is
still in flight, and the late pages are then dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from plumbing.transport import KVChannel, TransferState, Transfer, TransportError
from plumbing.transport.transfer import InvalidTransition
from plumbing import convert
from plumbing.config import WorkerConfig
from plumbing.rpc import ServiceError
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2, prefill_pb2
from plumbing.engine_service import EngineServicer

log = structlog.get_logger()
_MAX_RECORDS = 4096

_STATE_TO_PROTO = {
    TransferState.PENDING: kv_transfer_pb2.TRANSFER_STATE_PENDING,
    TransferState.BOOTSTRAPPING: kv_transfer_pb2.TRANSFER_STATE_BOOTSTRAPPING,
    TransferState.TRANSFERRING: kv_transfer_pb2.TRANSFER_STATE_TRANSFERRING,
    TransferState.DONE: kv_transfer_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: kv_transfer_pb2.TRANSFER_STATE_FAILED,
}


@dataclass
class PendingKV:
    """A reservation waiting for its pages (engine-thread owned)."""

    request_id: str
    transfer: Transfer
    block_ids: list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_deadline: float
    done: asyncio.Future[TransferState] = field(repr=False, default=None)  # type: ignore[assignment]
    header: kv_transfer_pb2.TransferHeader | None = None
    recv_started: float = 0.0
    # Held while pages are written into block_ids (receiver thread) and while the blocks are
    # freed (engine thread): a lease can never free blocks that are being written.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class DecodeWorker(EngineServicer, decode_pb2_grpc.DecodeWorkerServicer):
    role = common_pb2.WORKER_ROLE_DECODE
    role_name = "decode"

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        super().__init__(config, engine)
        self._transfer_ids = itertools.count(1)
        self._channel_ids = itertools.count(1)
        self.channels: dict[int, KVChannel] = {}
        self.pending: dict[int, PendingKV] = {}  # transfer_id -> record; engine thread mutates
        # Every recent transfer, pending or finished, for AwaitTransfer (bounded, oldest dropped).
        self.records: OrderedDict[int, PendingKV] = OrderedDict()
        self.layout = engine.kv_layout

    # -- the decode stream ---------------------------------------------------------------
    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid = str(request.request_id)
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_params_from_proto(request.sampling, request.stopping)
        if request.prefill_mode not in (decode_pb2.PREFILL_MODE_LOCAL, decode_pb2.PREFILL_MODE_REMOTE):
            raise ValueError(f"prefill_mode must be PREFILL_MODE_LOCAL or PREFILL_MODE_REMOTE, got {request.prefill_mode}")
        if rid in self.queues:
            raise ValueError(f"request_id {rid} is already being decoded here")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[rid] = queue
        finished = False
        start = time.monotonic()
        try:
            if request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL:
                await self.on_engine_thread(lambda e: e.add_request(prompt, params, request_id=rid))
            else:
                record = await self._reserve(rid, prompt, params, request)
                yield decode_pb2.DecodeResponse(
                    reserved=decode_pb2.Reservation(
                        transfer_id=record.transfer.transfer_id, num_blocks=len(record.block_ids)
                    )
                )
            first = True
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                chunk = self._chunk(item)
                if chunk is not None:
                    yield decode_pb2.DecodeResponse(tokens=chunk)
                if first and request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL:
                    first = False
                    prefill_us = int((time.monotonic() - start) * 1e6)
                if item.finished:
                    finished = True
                    log.info("decode.done", finish_reason=item.finish_reason, num_tokens=item.num_output_tokens,
                             num_draft_tokens=item.num_draft_tokens, num_accepted_tokens=item.num_accepted_tokens,
                             seconds=round(time.monotonic() - start, 6))
                    timings = common_pb2.PhaseTimings(
                        num_draft_tokens=item.num_draft_tokens,
                        num_accepted_tokens=item.num_accepted_tokens,
                        num_cached_prompt_tokens=item.num_cached_tokens,
                    )
                    if request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL:
                        timings.prefill_us = prefill_us
                    yield decode_pb2.DecodeResponse(
                        finished=decode_pb2.DecodeFinished(
                            finish_reason=convert.FINISH_REASONS[item.finish_reason], timings=timings
                        )
                    )
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished:
                log.info("decode.stopped_early", request_id=rid)
                self.engine_thread.call(lambda e: self._forget(e, rid, "decode stream ended"))

    @staticmethod
    def _chunk(out: RequestOutput) -> decode_pb2.TokenChunk | None:
        new = out.new_token_ids
        if not new:
            return None
        chunk = decode_pb2.TokenChunk(token_ids=new)
        if out.new_logprobs is not None:
            tops = out.new_top_logprobs or [None] * len(new)
            for token, lp, top in zip(new, out.new_logprobs, tops):
                chunk.logprobs.append(convert.token_logprob(token, lp, top))
        return chunk

    async def _reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, request: decode_pb2.DecodeRequest
    ) -> PendingKV:
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        wait_s = max(request.reservation_wait_ms, 1) / 1000.0
        lease_s = min(max(request.lease_ms, 1), self.config.max_lease_ms) / 1000.0
        deadline = time.monotonic() + wait_s
        transfer = Transfer(next(self._transfer_ids))
        done: asyncio.Future[TransferState] = self.loop.create_future()
        while True:
            record = await self.on_engine_thread(
                lambda e: self._try_reserve(e, rid, prompt, params, transfer, done, lease_s)
            )
            if record is not None:
                return record
            if time.monotonic() >= deadline:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no room for {len(prompt)} prompt tokens in the KV pool within "
                    f"reservation_wait_ms={request.reservation_wait_ms}",
                )
            await asyncio.sleep(0.005)

    def _try_reserve(
        self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams,
        transfer: Transfer, done: asyncio.Future[TransferState], lease_s: float,
    ) -> PendingKV | None:
        """Engine thread."""
        block_ids = engine.reserve_kv(rid, len(prompt))
        if block_ids is None:
            return None
        record = PendingKV(rid, transfer, list(block_ids), prompt, params,
                           lease_deadline=time.monotonic() + lease_s, done=done)
        self.pending[transfer.transfer_id] = record
        self.records[transfer.transfer_id] = record
        while len(self.records) > _MAX_RECORDS:
            self.records.popitem(last=False)
        self.num_in_transfer_blocks += len(block_ids)
        return record

    def _forget(self, engine: Engine, rid: str, reason: str) -> None:
        """Engine thread: free whatever ``rid`` holds here, exactly once."""
        for tid, record in list(self.pending.items()):
            if record.request_id == rid:
                self._drop_pending(engine, tid, reason)
                return
        engine.abort(rid)

    def _drop_pending(self, engine: Engine, transfer_id: int, reason: str) -> None:
        """Engine thread: fail a reservation and free its blocks (after any page write ends)."""
        record = self.pending.pop(transfer_id)
        with record.lock:
            record.transfer.fail(reason)
            engine.cancel_reservation(record.request_id)
        self.num_in_transfer_blocks -= len(record.block_ids)
        self.metrics.transfers.labels(role=self.role_name, outcome="failed").inc()
        self._resolve(record)
        log.info("kv.reservation_freed", request_id=record.request_id, reason=reason)

    def _resolve(self, record: PendingKV) -> None:
        state = record.transfer.state

        def set_done() -> None:
            if not record.done.done():
                record.done.set_result(state)

        self.loop.call_soon_threadsafe(set_done)

    def on_tick(self, engine: Engine) -> None:
        """Engine thread: expire leases whose pages never arrived."""
        now = time.monotonic()
        for tid, record in list(self.pending.items()):
            if now >= record.lease_deadline and record.transfer.state != TransferState.DONE:
                self._drop_pending(engine, tid, "lease expired before the KV pages arrived")
                self.push_threadsafe(record.request_id, ServiceError(
                    grpc.StatusCode.UNAVAILABLE, "KV pages did not arrive within the lease"))

    # -- KV channel ----------------------------------------------------------------------
    async def OpenKVChannel(
        self, request: kv_transfer_pb2.KVChannelHandshake, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.KVChannelAccept:
        try:
            peer_layout = convert.kv_layout_from_proto(request.kv_layout)
            self.layout.check_compatible(peer_layout)
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"kv_layout: {exc}") from None
        timeout_s = max(request.timeout_ms, 1) / 1000.0
        channel = await asyncio.get_running_loop().run_in_executor(
            None, self._join_channel, request, timeout_s
        )
        channel_id = next(self._channel_ids)
        self.channels[channel_id] = channel
        log.info("kv.channel_open", channel_id=channel_id, transport=channel.kind.value,
                 prefill_worker_id=request.prefill_worker_id)
        return kv_transfer_pb2.KVChannelAccept(channel_id=channel_id)

    def _join_channel(self, request: kv_transfer_pb2.KVChannelHandshake, timeout_s: float) -> KVChannel:
        if request.transport == kv_transfer_pb2.TRANSPORT_KIND_GLOO:
            from plumbing.transport.gloo import connect_gloo

            return connect_gloo(request.gloo.host, request.gloo.port, timeout_s=timeout_s)
        if request.transport == kv_transfer_pb2.TRANSPORT_KIND_NCCL:
            from plumbing.transport.nccl import NcclChannel

            if len(request.nccl_unique_id) != 128:
                raise ValueError(f"nccl_unique_id must be 128 bytes, got {len(request.nccl_unique_id)}")
            return NcclChannel(request.nccl_unique_id, rank=1,
                               device=torch.device(self.config.engine.device), timeout_s=timeout_s)
        raise ValueError(f"transport: unknown transport kind {request.transport}")

    async def AnnounceTransfer(
        self, header: kv_transfer_pb2.TransferHeader, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.TransferAck:
        """Post the receive for the next message on the channel. Only a success reply makes
        the prefill worker post its send, so both sides stay in the same order."""
        channel = self.channels.get(header.channel_id)
        if channel is None or channel.broken:
            self.channels.pop(header.channel_id, None)
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"channel_id {header.channel_id} is not open here")
        record = self.pending.get(header.transfer_id)
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"transfer_id {header.transfer_id} has no live reservation")
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

    def _on_pages(self, record: PendingKV, staging: torch.Tensor, error: BaseException | None) -> None:
        """Receiver thread: write the pages into the reserved blocks (unless the lease already
        ended), mark the transfer DONE, and queue the admission on the engine thread.

        The blocks belong to this reservation until it is admitted or freed, and freeing takes
        ``record.lock``, so writing them here, beside a running forward, is safe."""
        with record.lock:
            if record.transfer.finished:
                log.info("kv.late_pages_dropped", transfer_id=record.transfer.transfer_id)
                return
            if error is None:
                try:
                    self.engine.unpack_kv(record.request_id, staging)
                except Exception as exc:  # noqa: BLE001 - reported like a failed receive
                    error = exc
            if error is None:
                record.transfer.advance(TransferState.DONE)
        if error is None:
            seconds = time.monotonic() - record.recv_started
            self.metrics.transfer_bytes.inc(staging.numel() * staging.element_size())
            self.metrics.transfer_seconds.observe(seconds)
            self.metrics.transfers.labels(role=self.role_name, outcome="done").inc()
            self._resolve(record)
        self.engine_thread.call(lambda e: self._admit(e, record, error))

    def _admit(self, engine: Engine, record: PendingKV, error: BaseException | None) -> None:
        """Engine thread: turn a DONE transfer's reservation into a running sequence."""
        transfer_id = record.transfer.transfer_id
        if self.pending.get(transfer_id) is not record:
            return  # already freed (lease, cancel)
        rid = record.request_id
        if error is not None:
            self._drop_pending(engine, transfer_id, f"receive failed: {error}")
            self.push_threadsafe(rid, ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV receive failed: {error}"))
            return
        header = record.header
        assert header is not None
        first = header.first_logprob if header.HasField("first_logprob") else None
        try:
            engine.admit_prefilled(
                rid, record.prompt_token_ids, header.first_token_id, record.params,
                first_logprob=first.logprob if first is not None else None,
                first_top_logprobs=dict(first.top_logprobs) if first is not None and record.params.logprobs else None,
            )
        except ValueError as exc:
            self._drop_pending(engine, transfer_id, f"admission refused: {exc}")
            self.push_threadsafe(rid, ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        del self.pending[transfer_id]
        self.num_in_transfer_blocks -= len(record.block_ids)
        log.debug("kv.admitted", request_id=rid, num_blocks=len(record.block_ids))

    async def AwaitTransfer(
        self, request: kv_transfer_pb2.AwaitTransferRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.TransferStatus:
        record = self.records.get(request.transfer_id)
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"transfer_id {request.transfer_id} is unknown")
        timeout = max(request.timeout_ms, 1) / 1000.0 if request.timeout_ms else None
        try:
            await asyncio.wait_for(asyncio.shield(record.done), timeout)
        except asyncio.TimeoutError:
            pass
        return kv_transfer_pb2.TransferStatus(
            state=_STATE_TO_PROTO[record.transfer.state], error=record.transfer.error or ""
        )


def add_to_server(worker: DecodeWorker, server: grpc.aio.Server) -> None:
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)


SERVICE_NAME = "splitserve.v1.DecodeWorker"
