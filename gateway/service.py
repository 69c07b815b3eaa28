"""The gateway's public service: validate, route, run both legs, stream tokens back.

One attempt of a request::

    pick decode worker (lowest KV load) ── Decode(stream) ──▶ Reservation   (remote prefill)
    pick prefill worker (fewest queued prompt tokens) ── Prefill ──▶ first token
    Decode stream ──▶ TokenChunk … DecodeFinished

Prompts shorter than ``local_prefill_max_tokens`` (or any prompt when no prefill worker is
alive) are prefilled by the decode worker itself. A leg that fails cancels the other (the
workers free their blocks in their handlers' ``finally``); a failure before any token
reached the client is retried on other workers, after that it ends the stream with
UNAVAILABLE. Stop strings and detokenization happen here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from engine.chat import ChatTemplate
from gateway.registry import Registry, WorkerEntry
from gateway.text import TextStream
from gateway.validation import Limits, ValidatedRequest, validate
from splitserve.config import GatewayConfig
from splitserve.grpc_util import REQUEST_ID_KEY, TRACEPARENT_KEY, ServiceError, metadata_value
from splitserve.metrics import GatewayMetrics
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
)

log = structlog.get_logger()

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# gRPC details that mean the peer process is gone (as opposed to an application error).
_CONNECTION_LOST = ("Socket closed", "Connection reset", "failed to connect", "Connection refused",
                    "connections to all backends failing", "recvmsg", "Broken pipe", "GOAWAY")


class LegFailed(Exception):
    """A worker leg failed before the request finished."""

    def __init__(self, worker: WorkerEntry, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.worker = worker
        self.code = code
        self.details = details

    @property
    def connection_lost(self) -> bool:
        return self.code == grpc.StatusCode.UNAVAILABLE and any(s in self.details for s in _CONNECTION_LOST)


class NoWorker(Exception):
    """No live worker of a needed role is left to try."""


@dataclass
class Progress:
    start: float
    num_tokens: int = 0
    last_emit: float = 0.0
    first_token_at: float = 0.0
    timings: common_pb2.PhaseTimings | None = None

    @property
    def streamed(self) -> bool:
        return self.num_tokens > 0


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig, registry: Registry, tokenizer: object | None,
                 limits: Limits, metrics: GatewayMetrics, model_name: str) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        self.chat = ChatTemplate.of(tokenizer)  # None: chat requests are rejected
        self.limits = limits
        self.metrics = metrics
        self.model_name = model_name
        self._ids = itertools.count(time.time_ns() // 1000)
        self.num_in_flight = 0

    # -- RPCs ---------------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for response in self._generate(request, context):
            yield response

    async def GenerateUnary(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateUnaryResponse:
        result = gateway_pb2.GenerateUnaryResponse()
        async for chunk in self._generate(request, context):
            result.request_id = chunk.request_id
            result.token_ids.extend(chunk.token_ids)
            result.text += chunk.text
            result.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason:
                result.finish_reason = chunk.finish_reason
                result.timings.CopyFrom(chunk.timings)
                result.num_prompt_tokens = chunk.num_prompt_tokens
        return result

    async def GetInfo(
        self, request: gateway_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetInfoResponse:
        return gateway_pb2.GetInfoResponse(
            model=self.model_name, max_model_len=self.limits.max_model_len,
            vocab_size=self.limits.vocab_size, workers=self.registry.info(),
            local_prefill_max_tokens=self.config.local_prefill_max_tokens,
        )

    # -- one request --------------------------------------------------------------------
    async def _generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        rid = next(self._ids)
        structlog.contextvars.bind_contextvars(request_id=str(rid))
        await context.send_initial_metadata(((REQUEST_ID_KEY, str(rid)),))
        if self.num_in_flight >= self.config.max_in_flight:
            self.metrics.requests.labels(outcome="resource_exhausted").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.num_in_flight} requests in flight (max_in_flight={self.config.max_in_flight})")
        req = validate(request, self.tokenizer, self.limits, self.chat)
        self.num_in_flight += 1
        self.metrics.in_flight.inc()
        progress = Progress(start=time.monotonic())
        text = TextStream(self.tokenizer, req.prompt_token_ids, req.stop_strings)
        outcome = "error"
        try:
            async for response in self._with_retries(rid, request, req, text, progress, context):
                if response.finish_reason:
                    outcome = common_pb2.FinishReason.Name(response.finish_reason).lower()
                yield response
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.num_in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome=outcome).inc()
            self.metrics.e2e.observe(time.monotonic() - progress.start)
            t = progress.timings or common_pb2.PhaseTimings()
            log.info("request.done", outcome=outcome, num_prompt_tokens=len(req.prompt_token_ids),
                     num_tokens=progress.num_tokens, seconds=round(time.monotonic() - progress.start, 6),
                     ttft_s=round(progress.first_token_at - progress.start, 6) if progress.streamed else None,
                     queue_us=t.queue_us, prefill_us=t.prefill_us, transfer_us=t.transfer_us,
                     transfer_bytes=t.transfer_bytes)

    async def _with_retries(
        self, rid: int, request: gateway_pb2.GenerateRequest, req: ValidatedRequest,
        text: TextStream, progress: Progress, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        excluded: set[int] = set()
        last: LegFailed | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                async for response in self._attempt(rid, request, req, text, progress, context, excluded):
                    yield response
                return
            except NoWorker as exc:
                if last is None:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                raise self._final_error(last) from None
            except LegFailed as exc:
                last = exc
                if exc.connection_lost:
                    self.registry.drop(exc.worker.worker_id, f"lost during a request: {exc.details}")
                excluded.add(exc.worker.worker_id)
                log.warning("request.leg_failed", attempt=attempt, worker_id=exc.worker.worker_id,
                            code=exc.code.name, details=exc.details, streamed=progress.streamed)
                if progress.streamed or exc.code not in _RETRYABLE or attempt == self.config.max_attempts:
                    raise self._final_error(exc) from None
                self.metrics.retries.inc()

    @staticmethod
    def _final_error(exc: LegFailed) -> ServiceError:
        """What the client sees when a leg failed and no retry is left."""
        passthrough = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.DEADLINE_EXCEEDED)
        code = exc.code if exc.code in passthrough else grpc.StatusCode.UNAVAILABLE
        return ServiceError(code, f"worker {exc.worker.address} failed: {exc.details}")

    async def _attempt(
        self, rid: int, request: gateway_pb2.GenerateRequest, req: ValidatedRequest, text: TextStream,
        progress: Progress, context: grpc.aio.ServicerContext, excluded: set[int],
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        decode = self.registry.pick_decode(excluded)
        if decode is None:
            raise NoWorker("no live decode worker")
        prompt = req.prompt_token_ids
        has_prefill = self.registry.pick_prefill(excluded) is not None
        local = len(prompt) < self.config.local_prefill_max_tokens or not has_prefill
        metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_KEY, str(rid)),)
        traceparent = metadata_value(context, TRACEPARENT_KEY)
        if traceparent is not None:
            metadata += ((TRACEPARENT_KEY, traceparent),)
        timeout = context.time_remaining()
        call = decode.stub.Decode(  # type: ignore[attr-defined]
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=request.sampling, stopping=request.stopping,
                prefill_mode=decode_pb2.PREFILL_MODE_LOCAL if local else decode_pb2.PREFILL_MODE_REMOTE,
                reservation_wait_ms=self.config.reservation_wait_ms, lease_ms=self.config.lease_ms,
            ),
            metadata=metadata, timeout=timeout,
        )
        decode.num_routed += 1
        prefill_task: asyncio.Task[prefill_pb2.PrefillResponse] | None = None
        prefill: WorkerEntry | None = None
        try:
            pending_msg: decode_pb2.DecodeResponse | None = None
            if not local:
                reserved = await self._read(call, decode)
                if reserved is None or reserved.WhichOneof("event") != "reserved":
                    raise LegFailed(decode, grpc.StatusCode.INTERNAL, "decode stream did not start with a reservation")
                prefill = self.registry.pick_prefill(excluded)
                if prefill is None:
                    raise NoWorker("no live prefill worker")
                prefill.num_routed_prefill_tokens += len(prompt)
                progress_queue_us = int((time.monotonic() - progress.start) * 1e6)
                prefill_task = asyncio.ensure_future(prefill.stub.Prefill(  # type: ignore[attr-defined]
                    prefill_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling=request.sampling,
                        stopping=request.stopping,
                        target=prefill_pb2.DecodeTarget(
                            worker_id=decode.worker_id, address=decode.address,
                            transfer_id=reserved.reserved.transfer_id, num_blocks=reserved.reserved.num_blocks,
                        ),
                    ),
                    metadata=metadata, timeout=context.time_remaining(),
                ))
                first, pending_msg = await self._await_prefill(prefill_task, prefill, call, decode)
                progress.timings = common_pb2.PhaseTimings()
                progress.timings.CopyFrom(first.timings)
                progress.timings.queue_us = progress_queue_us
                logprobs = [first.first_logprob] if first.HasField("first_logprob") else []
                response = self._emit(rid, [first.first_token_id], logprobs, text, progress)
                yield response
                if text.stopped:
                    yield self._final(rid, common_pb2.FINISH_REASON_STOP, req, text, progress, None)
                    return
            while True:
                msg = pending_msg if pending_msg is not None else await self._read(call, decode)
                pending_msg = None
                if msg is None:
                    raise LegFailed(decode, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a finish")
                kind = msg.WhichOneof("event")
                if kind == "tokens":
                    if progress.timings is None:  # local prefill: the first chunk ends the prefill
                        progress.timings = common_pb2.PhaseTimings()
                    yield self._emit(rid, list(msg.tokens.token_ids), list(msg.tokens.logprobs), text, progress)
                    if text.stopped:
                        yield self._final(rid, common_pb2.FINISH_REASON_STOP, req, text, progress, None)
                        return
                elif kind == "finished":
                    yield self._final(rid, msg.finished.finish_reason, req, text, progress, msg.finished.timings)
                    return
        finally:
            decode.num_routed -= 1
            if prefill is not None:
                prefill.num_routed_prefill_tokens -= len(prompt)
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            call.cancel()

    @staticmethod
    async def _read(call: grpc.aio.UnaryStreamCall, worker: WorkerEntry) -> decode_pb2.DecodeResponse | None:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise LegFailed(worker, exc.code(), exc.details() or "") from None
        return None if msg is grpc.aio.EOF else msg

    async def _await_prefill(
        self, prefill_task: asyncio.Task[prefill_pb2.PrefillResponse], prefill: WorkerEntry,
        call: grpc.aio.UnaryStreamCall, decode: WorkerEntry,
    ) -> tuple[prefill_pb2.PrefillResponse, decode_pb2.DecodeResponse | None]:
        """Wait for the prefill leg while watching the decode leg: either failing cancels the other."""
        read_task = asyncio.ensure_future(self._read(call, decode))
        try:
            done, _ = await asyncio.wait({prefill_task, read_task}, return_when=asyncio.FIRST_COMPLETED)
            if read_task in done and read_task.exception() is not None:
                exc = read_task.exception()
                if isinstance(exc, LegFailed) and not exc.connection_lost:
                    # The decode worker is alive but gave up on the pages (lease, failed
                    # receive): the prefill side is the one to avoid on the retry.
                    raise LegFailed(prefill, exc.code, exc.details)
                raise exc  # type: ignore[misc]
            try:
                first = await prefill_task
            except grpc.aio.AioRpcError as exc:
                raise LegFailed(prefill, exc.code(), exc.details() or "") from None
            return first, await read_task
        finally:
            if not read_task.done():
                read_task.cancel()

    def _emit(self, rid: int, token_ids: list[int], logprobs: list[common_pb2.TokenLogprob],
              text: TextStream, progress: Progress) -> gateway_pb2.GenerateResponse:
        now = time.monotonic()
        if not progress.streamed:
            progress.first_token_at = now
            self.metrics.ttft.observe(now - progress.start)
        elif token_ids:
            gap = (now - progress.last_emit) / len(token_ids)
            for _ in token_ids:
                self.metrics.itl.observe(gap)
        progress.num_tokens += len(token_ids)
        progress.last_emit = now
        return gateway_pb2.GenerateResponse(request_id=rid, token_ids=token_ids, text=text.add(token_ids),
                                            logprobs=logprobs)

    def _final(self, rid: int, reason: int, req: ValidatedRequest, text: TextStream, progress: Progress,
               decode_timings: common_pb2.PhaseTimings | None) -> gateway_pb2.GenerateResponse:
        timings = common_pb2.PhaseTimings()
        if progress.timings is not None:
            timings.CopyFrom(progress.timings)
        if decode_timings is not None:
            timings.num_draft_tokens = decode_timings.num_draft_tokens
            timings.num_accepted_tokens = decode_timings.num_accepted_tokens
            if decode_timings.prefill_us:
                timings.prefill_us = decode_timings.prefill_us
            if not timings.num_cached_prompt_tokens:
                timings.num_cached_prompt_tokens = decode_timings.num_cached_prompt_tokens
        now = time.monotonic()
        timings.first_token_us = int(((progress.first_token_at or now) - progress.start) * 1e6)
        timings.total_us = int((now - progress.start) * 1e6)
        return gateway_pb2.GenerateResponse(
            request_id=rid, text=text.flush(), finish_reason=reason or common_pb2.FINISH_REASON_STOP,
            timings=timings, num_prompt_tokens=len(req.prompt_token_ids),
        )
