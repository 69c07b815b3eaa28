"""The prefill worker's gRPC service.

``Prefill``: the prompt joins the engine's batch (chunked prefill, prefix cache) with
``max_tokens=1`` and ``hold_kv``; once the first token is sampled the transfer is announced
to the decode worker (which streams the first token to the gateway at once: its only route
there; this call answers with the timings alone) and, without
waiting for the reply, the held pages the decode worker lacks are packed chunk by chunk into
reused staging buffers (off the engine thread) and sent on one of the pair's lanes
(``kv_channels.py``) while later chunks pack; once the last chunk is sent the held blocks are
released (the decode worker's stream reports whether the pages
landed: no ``AwaitTransfer`` round trip). Any failure or cancellation releases them too —
exactly once, in the ``finally`` — and the transport never touches a block, only the
staging copies.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from engine.engine import Engine
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from plumbing import convert
from plumbing.config import WorkerConfig
from plumbing.identity import TRANSFER_SECRET_BYTES, frame_tag
from plumbing.rpc import INCARNATION_KEY, ServiceError
from plumbing.transport.pages import chunk_blocks_for
from splitserve_api.v1 import common_pb2, kv_transfer_pb2, prefill_pb2, prefill_pb2_grpc
from plumbing.engine_service import EngineServicer
from prefill_worker.kv_channels import KVChannelPool
from prefill_worker.lease_keeper import keep_lease

log = structlog.get_logger()


class PrefillWorker(EngineServicer, prefill_pb2_grpc.PrefillWorkerServicer):
    role = common_pb2.WORKER_ROLE_PREFILL
    role_name = "prefill"

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        super().__init__(config, engine)
        self.channels = KVChannelPool(
            engine.kv_layout, config.resolved_transport(), config.server.public_host,
            config.engine.device, config.kv_channel_timeout_s, self.incarnation, config.fault_transfer_stall_s,
            security=self.channel_security, num_lanes=config.kv_channels_per_peer,
        )
        self._num_shipped = 0  # transfers ended (progress for the lease keep-alive, with engine steps)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        context.set_trailing_metadata(((INCARNATION_KEY, str(self.incarnation)),))  # gateway/legs.py
        rid = str(request.request_id)
        prompt = list(request.prompt_token_ids)
        params = convert.sampling_params_from_proto(request.sampling, request.stopping, request.constraint).for_prefill()
        if not request.target.address:
            raise ValueError("target.address must name the decode worker")
        num_prior = request.num_prior_output_tokens
        self.check_prompt(prompt, num_prior)
        if not request.target.incarnation:
            raise ValueError("target.incarnation must be the decode worker's (from its Reservation)")
        if len(request.target.transfer_secret) != TRANSFER_SECRET_BYTES:
            raise ValueError(f"target.transfer_secret must be {TRANSFER_SECRET_BYTES} bytes (from the Reservation)")
        await self.open_stream(rid, "prefilled")
        ship: asyncio.Future[None] | None = None
        keeper = asyncio.ensure_future(keep_lease(
            lambda: self.channels.peer(request.target.address).stub, request.target,
            lambda: self.engine_thread.num_steps + self._num_shipped, self.config.kv_channel_timeout_s))
        try:
            out, timings = await self._first_token(rid, prompt, params, num_prior)
            first_logprob = None
            if out.logprobs:
                tops = out.top_logprobs[0] if out.top_logprobs else None
                first_logprob = convert.token_logprob(out.token_ids[0], out.logprobs[0], tops)
            ship = asyncio.ensure_future(self._ship(request, out.token_ids[0], first_logprob, timings))
            await asyncio.shield(ship)
            return prefill_pb2.PrefillResponse(timings=timings)  # the first token went on the Decode stream
        except BaseException:
            self.metrics.transfers.labels(role=self.role_name, outcome="failed").inc()
            raise
        finally:
            keeper.cancel()
            keeper.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._release_after(ship, rid)

    def _release_after(self, ship: asyncio.Future[None] | None, rid: str) -> None:
        """Free the held blocks once, and never while a pack may still read them: a call
        cancelled mid-transfer frees them when its (bounded) transfer task ends."""
        def release(task: asyncio.Future[None] | None = None) -> None:
            if task is not None and not task.cancelled():
                task.exception()  # taken: the cancelled caller no longer waits for it
            self.close_stream(rid, lambda e: self._free(e, rid))

        if ship is not None and not ship.done():
            ship.add_done_callback(release)
        else:
            release()

    async def _first_token(
        self, rid: str, prompt: list[int], params: SamplingParams, num_prior: int,
    ) -> tuple[CompletionOutput, common_pb2.PhaseTimings]:
        """Run the prompt in the engine's batch (its KV held) to its first token."""
        start = time.monotonic()
        await self.on_engine_thread(lambda e: e.add_request(prompt, params, request_id=rid, hold_kv=True,
                                                            num_prior_draws=num_prior))
        out = CompletionOutput(rid, prompt)
        while not out.finished:
            out.add(await self.queues[rid].get())
        self.metrics.prompt_tokens.inc(len(prompt) - out.num_cached_tokens)
        if out.finish_reason == "error":
            raise ServiceError(grpc.StatusCode.DATA_LOSS, f"request {rid}: {out.error}")
        if out.finish_reason == "abort" or not out.token_ids:
            raise ServiceError(grpc.StatusCode.ABORTED, "prefill was aborted")
        return out, common_pb2.PhaseTimings(prefill_us=int((time.monotonic() - start) * 1e6),
                                            num_cached_prompt_tokens=out.num_cached_tokens)

    async def _ship(self, request: prefill_pb2.PrefillRequest, first_token_id: int,
                    first_logprob: common_pb2.TokenLogprob | None, timings: common_pb2.PhaseTimings) -> None:
        """Announce the transfer, then pack the held pages the decode worker lacks (those after
        its ``num_cached_blocks`` prefix hits) chunk by chunk while earlier chunks are on the
        wire. Returns once the last chunk is sent; whether the pages landed is the decode
        worker's to report (its Decode stream). Fills the transfer fields of ``timings``."""
        target = request.target
        rid = str(request.request_id)
        block_ids = await self.on_engine_thread(lambda engine: engine.handoff.held_block_ids(rid))
        if target.num_cached_blocks >= len(block_ids):
            raise ValueError(f"target.num_cached_blocks={target.num_cached_blocks} must be below the "
                             f"prompt's {len(block_ids)} blocks")
        ids = block_ids[target.num_cached_blocks:]
        layout = self.engine.kv_layout
        num_bytes = len(ids) * layout.bytes_per_block
        timings.transfer_bytes = num_bytes
        header = kv_transfer_pb2.TransferHeader(
            transfer_id=target.transfer_id, transfer_secret=target.transfer_secret,
            request_id=request.request_id, num_blocks=len(ids), num_cached_blocks=target.num_cached_blocks,
            chunk_blocks=chunk_blocks_for(layout.bytes_per_block, self.config.kv_chunk_bytes),
            num_bytes=num_bytes, num_prompt_tokens=len(request.prompt_token_ids),
            first_token_id=first_token_id,
        )
        if first_logprob is not None:
            header.first_logprob.CopyFrom(first_logprob)
        t_transfer = time.monotonic()
        try:
            wire_s = await self.channels.announce_and_send(
                target.address, target.incarnation, header,
                lambda start, n, out: self.engine.handoff.pack_kv(ids[start:start + n], out),
                frame_tag(target.transfer_id, target.transfer_secret))
        finally:
            self._num_shipped += 1
        seconds = time.monotonic() - t_transfer
        timings.transfer_wire_us = int(wire_s * 1e6)
        timings.transfer_us = int(seconds * 1e6)
        self.metrics.transfer_bytes.inc(num_bytes)
        self.metrics.transfer_seconds.observe(seconds)
        self.metrics.transfers.labels(role=self.role_name, outcome="done").inc()
        log.info("prefill.done", num_prompt_tokens=len(request.prompt_token_ids), transfer_bytes=num_bytes,
                 num_cached_blocks=target.num_cached_blocks, prefill_s=round(timings.prefill_us / 1e6, 6),
                 transfer_s=round(seconds, 6))

    def _free(self, engine: Engine, rid: str) -> None:
        """Engine thread: release the held pages (or abort a still-running prefill), once."""
        if not engine.handoff.release_kv(rid):
            engine.abort(rid)


def add_to_server(worker: PrefillWorker, server: grpc.aio.Server) -> None:
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(worker, server)


SERVICE_NAME = "splitserve.v1.PrefillWorker"
