"""The gateway's public service: validate, route (with retries before the first token),
stream tokens back. One attempt's two legs are ``gateway/legs.py``'s; a request's state is
``gateway/request.py``'s; stop strings and detokenization are ``gateway/text.py``'s.

A failure before any token reached the client is retried on other workers (up to
``max_attempts``), avoiding the worker that failed. A failure after that *migrates* the
request (up to ``max_migrations`` times): another decode worker prefills the prompt plus
the tokens already sent and streams on from there, so the client sees every token once and
no gap; the request's ``TextStream`` carries the text and stop strings across. Past the
budget (or with no survivor) the stream ends with UNAVAILABLE. A *resumed* request (its client
lost a stream, on this gateway or another) starts as such a migration (``GatewayRequest.resume``).

The event loop stays free for heartbeats: tokenizing and chat rendering run on one
tokenizer thread (HF fast tokenizers are not safe to call concurrently; the byte cap of
``gateway/prompt.py`` bounds each call), only cheap checks run on the loop. Request ids are
minted (random 64-bit), never counted, so nobody can predict the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from engine.chat import ChatTemplate
from gateway import legs
from gateway.admission import AdmissionLimits, PrefillAdmission
from gateway.legs import LegFailed, NoWorker
from gateway.registry import Registry
from gateway.request import GatewayRequest
from gateway.text import TextStream
from gateway.prompt import prompt_token_ids
from engine.grammar import GrammarCompiler
from gateway.validation import Limits, ValidatedRequest, check_constraint_compiles, finish, precheck
from plumbing import tracing
from plumbing.config import GatewayConfig
from plumbing.identity import mint_id
from plumbing.metrics import GatewayMetrics
from plumbing.rpc import REQUEST_ID_KEY, TRACEPARENT_KEY, ServiceError, check_request_id, metadata_value
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger()

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# DATA_LOSS: the model's logits were not finite (engine FINISHED_ERROR); a retry gives the same.
_PASSTHROUGH = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS)


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
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, limits.vocab_size, limits.eos_token_ids)
        self.num_in_flight = 0
        self.admission = PrefillAdmission(
            lambda: registry.live(common_pb2.WORKER_ROLE_PREFILL),
            AdmissionLimits(config.prefill_queue_max_tokens, config.admission_max_waiting,
                            config.admission_max_wait_ms / 1000.0), metrics)

    # -- RPCs ---------------------------------------------------------------------------
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for response in self._generate(request, context):
            yield response

    async def GenerateUnary(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        result = gateway_pb2.GenerateResponse()
        async for chunk in self._generate(request, context):
            text = result.text + chunk.text
            result.MergeFrom(chunk)  # appends token_ids and logprobs; the final chunk sets the rest
            result.text = text
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
        rid = mint_id()
        # The client's x-request-id names the request in every service's log lines and is
        # echoed; the minted id keys the request between the services (unguessable).
        log_id = check_request_id(metadata_value(context, REQUEST_ID_KEY)) or str(rid)
        structlog.contextvars.bind_contextvars(request_id=log_id)
        admitted = self.num_in_flight < self.config.max_in_flight
        if admitted:  # taken before any await: concurrent requests cannot all pass the check
            self.num_in_flight += 1
            self.metrics.in_flight.inc()
        req: GatewayRequest | None = None
        outcome = "error"
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, log_id),))
            if not admitted:
                self.metrics.requests.labels(outcome="resource_exhausted").inc()
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.num_in_flight} requests in flight "
                                   f"(max_in_flight={self.config.max_in_flight})")
            req = await self._admit(request, context, rid, log_id)
            async for response in self._with_retries(req):
                if response.finish_reason:
                    outcome = common_pb2.FinishReason.Name(response.finish_reason).lower()
                yield response
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled at a yield
            outcome = "cancelled"
            raise
        finally:
            if admitted:
                self.num_in_flight -= 1
                self.metrics.in_flight.dec()
            if req is not None:
                self._record_done(req, outcome)

    async def _admit(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                     rid: int, log_id: str) -> GatewayRequest:
        """The validated request, with what its legs send along."""
        validated = await self._validate(request)
        metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_KEY, log_id),)
        traceparent = metadata_value(context, TRACEPARENT_KEY)
        if traceparent is not None and not tracing.enabled():  # else the tracing interceptor sends its own
            metadata += ((TRACEPARENT_KEY, traceparent),)
        req = GatewayRequest(rid, validated, TextStream(self.tokenizer, validated.prompt_token_ids,
                                                        validated.stop_strings),
                             metadata, context.time_remaining, self.metrics)
        req.resume()  # a resumed request: the tokens (and text) its client already has
        return req

    async def _validate(self, request: gateway_pb2.GenerateRequest) -> ValidatedRequest:
        """``validation.validate``, its costly middle step off the event loop."""
        precheck(request, self.limits)
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(
            self._tokenizer_thread, prompt_token_ids, request, self.tokenizer, self.chat)
        validated = finish(request, prompt, self.limits, self.chat)
        if validated.params.constraint is not None:
            await loop.run_in_executor(self._tokenizer_thread, check_constraint_compiles, validated.params, self.grammars)
        return validated

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def _record_done(self, req: GatewayRequest, outcome: str) -> None:
        seconds = time.monotonic() - req.start
        self.metrics.requests.labels(outcome=outcome).inc()
        self.metrics.e2e.observe(seconds)
        t = req.timings or common_pb2.PhaseTimings()
        log.info("request.done", outcome=outcome, num_prompt_tokens=len(req.prompt_token_ids),
                 num_tokens=req.num_tokens, seconds=round(seconds, 6),
                 ttft_s=round(req.first_token_at - req.start, 6) if req.streamed else None,
                 queue_us=t.queue_us, prefill_us=t.prefill_us, transfer_us=t.transfer_us,
                 transfer_bytes=t.transfer_bytes)

    async def _with_retries(self, req: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        last: LegFailed | None = None
        resumed_finish = req.finished_on_resume(self.limits)
        if resumed_finish is not None:  # its stream broke after the last token, before the final chunk
            yield req.final(resumed_finish, None)
            return
        if not self.registry.live(common_pb2.WORKER_ROLE_DECODE):  # just (re)started: let workers register
            remaining = req.time_remaining()
            wait_s = self.registry.startup_left_s()
            await self.registry.wait_for_decode(wait_s if remaining is None else min(wait_s, remaining))
        attempt = 0
        while True:
            attempt += 1
            try:
                async for response in legs.attempt(req, self.registry, self.config.local_prefill_max_tokens,
                                                   self.config.reservation_wait_ms, self.config.lease_ms,
                                                   admission=self.admission):
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
                req.excluded.add(exc.worker.worker_id)
                role = "decode" if exc.worker.role == common_pb2.WORKER_ROLE_DECODE else "prefill"
                self.metrics.leg_failures.labels(role=role, code=exc.code.name).inc()
                log.warning("request.leg_failed", attempt=attempt, worker_id=exc.worker.worker_id,
                            code=exc.code.name, details=exc.details, num_sent=req.num_tokens)
                if req.streamed:
                    reason = req.finished_by_sent(self.limits)
                    if reason is not None:  # the worker died after its last token: done
                        yield req.final(reason, None)
                        return
                    self._migrate(req, exc)
                    continue
                if exc.code not in _RETRYABLE or attempt >= self.config.max_attempts:
                    raise self._final_error(exc) from None
                self.metrics.retries.inc()

    def _migrate(self, req: GatewayRequest, exc: LegFailed) -> None:
        """Count a continuation of a request whose tokens reached the client, or raise the
        final error when it may not be continued."""
        if exc.code not in _RETRYABLE or req.migrations >= self.config.max_migrations:
            raise self._final_error(exc) from None
        req.migrations += 1
        self.metrics.migrations.inc()
        log.info("request.migrating", migration=req.migrations, num_sent=req.num_tokens,
                 from_worker_id=exc.worker.worker_id)

    @staticmethod
    def _final_error(exc: LegFailed) -> ServiceError:
        """What the client sees when a leg failed and no retry is left."""
        code = exc.code if exc.code in _PASSTHROUGH else grpc.StatusCode.UNAVAILABLE
        return ServiceError(code, f"worker {exc.worker.address} failed: {exc.details}")
