"""The decode worker's gRPC service.

Remote prefill, as seen from here::

    gateway ──Decode──▶ reserve blocks (wait ≤ reservation_wait_ms) ──▶ stream: Reservation
    prefill ──OpenKVChannel──▶ join the pair's channel (once per pair; layout checked)
    prefill ──AnnounceTransfer──▶ post a recv per message into staging buffers (announcement order)
                               ──▶ stream: FirstToken (before the pages)
              each message lands ──▶ its pages into the reservation; after the last: DONE,
                                     engine thread: admit
    engine steps ──▶ stream: TokenChunk … DecodeFinished   (a failed transfer: the stream's error)

The reservation takes this worker's own prefix-cache hits first (``Reservation.num_cached_blocks``);
only the blocks after them receive pages. The gateway learns a transfer's fate from this stream.
A local prefill waits for room in the same queue, with the same ``reservation_wait_ms`` and the
same RESOURCE_EXHAUSTED past it, before the engine takes the prompt.

A reservation's life is one state machine (``reservation.py``); the table of live ones
(``reservations.py``) is the engine thread's, which is also where leases expire and received
pages are admitted. The KV channels and receives are ``kv_inbox.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from decode_worker.kv_inbox import KVInbox
from decode_worker.reservation import Reservation
from decode_worker.reservations import ReservationTable
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from plumbing import convert
from plumbing.config import WorkerConfig
from plumbing.engine_service import EngineServicer
from plumbing.rpc import INCARNATION_KEY, ServiceError, peer_host
from splitserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2

log = structlog.get_logger()
_MODES = (decode_pb2.PREFILL_MODE_LOCAL, decode_pb2.PREFILL_MODE_REMOTE)


class DecodeWorker(EngineServicer, decode_pb2_grpc.DecodeWorkerServicer):
    role = common_pb2.WORKER_ROLE_DECODE
    role_name = "decode"

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        super().__init__(config, engine)
        self.reservations = ReservationTable(
            self.loop, self.push_threadsafe,
            lambda: self.metrics.transfers.labels(role=self.role_name, outcome="failed").inc(),
            config.max_reservations_per_request,
        )
        self.inbox = KVInbox(engine, self.reservations, config.engine.device, self.metrics,
                             self.engine_thread.call, self.incarnation, config.kv_channel_timeout_s,
                             on_announced=self._first_token)

    def _first_token(self, reservation: Reservation) -> None:
        """Event loop, on an accepted announce: the first token to the request's stream, ahead
        of the pages (its tokens from the engine can only follow the admission)."""
        header = reservation.header
        assert header is not None
        first = decode_pb2.FirstToken(token_id=header.first_token_id)
        if header.HasField("first_logprob"):
            first.logprob.CopyFrom(header.first_logprob)
        queue = self.queues.get(reservation.request_id)
        if queue is not None:
            queue.put_nowait(first)

    def on_tick(self, engine: Engine) -> None:
        """Engine thread, every iteration: expire leases, then serve waiting reservations."""
        num_expired = self.reservations.expire_leases(engine)
        if num_expired:
            self.metrics.leases_expired.inc(num_expired)
        self.reservations.serve_waiters(engine)

    # -- the decode stream ---------------------------------------------------------------
    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        context.set_trailing_metadata(((INCARNATION_KEY, str(self.incarnation)),))  # gateway/legs.py
        rid = str(request.request_id)
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_params_from_proto(request.sampling, request.stopping, request.constraint)
        if request.prefill_mode not in _MODES:
            raise ValueError(f"prefill_mode must be PREFILL_MODE_LOCAL or PREFILL_MODE_REMOTE, got {request.prefill_mode}")
        self.check_prompt(prompt, request.num_prior_output_tokens)
        queue: asyncio.Queue[RequestOutput | BaseException] = await self.open_stream(rid, "decoded")
        finished = False
        start = time.monotonic()
        try:
            local = request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL
            reservation = await self._reserve(rid, prompt, params, request, local)
            if reservation is not None:
                yield decode_pb2.DecodeResponse(reserved=decode_pb2.Reservation(
                    transfer_id=reservation.transfer_id, num_blocks=len(reservation.block_ids),
                    transfer_secret=reservation.secret, incarnation=self.incarnation,
                    num_cached_blocks=reservation.num_cached_blocks))
            async for response in self._stream(request, queue, start):
                finished = response.WhichOneof("event") == "finished"
                yield response
        finally:
            if not finished:
                log.info("decode.stopped_early", request_id=rid)
            self.inbox.receive_us.pop(rid, None)
            self.close_stream(rid, None if finished else
                              lambda e: self.reservations.forget(e, rid, "decode stream ended"))

    async def _stream(self, request: decode_pb2.DecodeRequest, queue: asyncio.Queue[RequestOutput | BaseException],
                      start: float) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Tokens as the engine thread produces them, then the finish."""
        local = request.prefill_mode == decode_pb2.PREFILL_MODE_LOCAL
        prefill_us = 0
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, decode_pb2.FirstToken):
                yield decode_pb2.DecodeResponse(first_token=item)
                continue
            if item.finish_reason == "error":
                raise ServiceError(grpc.StatusCode.DATA_LOSS, f"request {item.request_id}: {item.error}")
            chunk = self._chunk(item)
            if chunk is not None:
                yield decode_pb2.DecodeResponse(tokens=chunk)
            if local and not prefill_us:
                prefill_us = int((time.monotonic() - start) * 1e6)
            if item.finished:
                log.info("decode.done", finish_reason=item.finish_reason, num_tokens=item.num_output_tokens,
                         num_draft_tokens=item.num_draft_tokens, num_accepted_tokens=item.num_accepted_tokens,
                         seconds=round(time.monotonic() - start, 6))
                timings = common_pb2.PhaseTimings(
                    num_draft_tokens=item.num_draft_tokens, num_accepted_tokens=item.num_accepted_tokens,
                    # A remote prefill's hits here are the reservation's (pages not shipped), not
                    # prompt tokens this request was spared computing: GetStats counts them.
                    num_cached_prompt_tokens=item.num_cached_tokens if local else 0,
                    prefill_us=prefill_us if local else 0,
                    transfer_us=self.inbox.receive_us.pop(item.request_id, 0),
                )
                yield decode_pb2.DecodeResponse(finished=decode_pb2.DecodeFinished(
                    finish_reason=convert.FINISH_REASONS[item.finish_reason], timings=timings))
                return

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

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams,
                       request: decode_pb2.DecodeRequest, local: bool) -> Reservation | None:
        """Blocks for the prompt's pages (remote: the reservation), or room for its local
        prefill (then the engine has the request: None), waiting (event-driven, in arrival
        order) up to ``reservation_wait_ms`` for them to free up."""
        wait_s = max(request.reservation_wait_ms, 1) / 1000.0
        lease_s = min(max(request.lease_ms, 1), self.config.max_lease_ms) / 1000.0
        num_prior = request.num_prior_output_tokens
        table = self.reservations
        granted = await self.on_engine_thread(
            (lambda e: table.request_local(e, rid, prompt, params, wait_s, num_prior)) if local else
            (lambda e: table.request(e, rid, prompt, params, lease_s, wait_s, num_prior)))
        result = await granted
        if result is None:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no room for {len(prompt)} prompt tokens in the KV pool within "
                f"reservation_wait_ms={request.reservation_wait_ms}",
            )
        return None if local else result

    # -- KV channel ----------------------------------------------------------------------
    async def OpenKVChannel(
        self, request: kv_transfer_pb2.KVChannelHandshake, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.KVChannelAccept:
        return await self.inbox.open_channel(request, peer_host(context))

    async def RenewLease(
        self, request: kv_transfer_pb2.LeaseRenewal, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.LeaseGrant:
        """A prefill worker's keep-alive for the reservation whose pages it computes
        (``Reservation.renew``); event loop, no engine-thread hop."""
        if request.decode_incarnation != self.incarnation:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"decode_incarnation {request.decode_incarnation} is not this worker's")
        reservation = self.reservations.lookup(request.transfer_id, request.transfer_secret)
        left = None if reservation is None else reservation.renew(
            time.monotonic(), self.config.max_reservation_hold_ms / 1000.0)
        if left is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"transfer_id {request.transfer_id} names no live "
                               "reservation (it ended, or its lease ran out)")
        if left:
            self.metrics.lease_renewals.inc()
        return kv_transfer_pb2.LeaseGrant(lease_ms_left=int(left * 1000))

    async def AnnounceTransfer(
        self, header: kv_transfer_pb2.TransferHeader, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.TransferAck:
        return self.inbox.announce(header)


def add_to_server(worker: DecodeWorker, server: grpc.aio.Server) -> None:
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)


SERVICE_NAME = "splitserve.v1.DecodeWorker"
