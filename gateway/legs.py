"""One routing attempt of a request: the decode leg and, for a remote prefill, the prefill leg::

    pick decode worker (gateway/routing.py) ── Decode(stream) ──▶ Reservation   (remote prefill)
    pick prefill worker (gateway/routing.py) ── Prefill ──▶ first token
    Decode stream ──▶ TokenChunk … DecodeFinished

Prompts shorter than ``local_prefill_max_tokens`` (with prefix routing: whose part the
decode worker does not hold is that short, or that worker holds most of the prompt), or any
prompt when no prefill worker is alive, are prefilled by the decode worker itself
(``Router.prefill_locally``). A migration (an attempt after tokens were sent) routes and
prefills the prompt plus those tokens the same way, with the budgets that are left. A leg
that fails cancels the other (the workers free their blocks in their handlers' ``finally``)
and raises ``LegFailed`` naming the worker to blame; the service decides whether to retry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc

from gateway.registry import Registry, WorkerEntry
from gateway.request import GatewayRequest
from gateway.routing import LEG_LOCAL, LEG_PREFILL
from splitserve.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2

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


async def attempt(req: GatewayRequest, registry: Registry, local_prefill_max_tokens: int,
                  reservation_wait_ms: int, lease_ms: int) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Route ``req`` once and stream its chunks; LegFailed / NoWorker on failure."""
    router = registry.router
    route = router.pick_decode(req)
    if route is None:
        raise NoWorker("no live decode worker")
    decode = route.worker
    prompt = req.attempt_prompt
    local = router.prefill_locally(req, route, local_prefill_max_tokens)
    call = decode.stub.Decode(  # type: ignore[attr-defined]
        decode_pb2.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=prompt, sampling=req.validated.sampling,
            stopping=req.attempt_stopping,
            prefill_mode=decode_pb2.PREFILL_MODE_LOCAL if local else decode_pb2.PREFILL_MODE_REMOTE,
            reservation_wait_ms=reservation_wait_ms, lease_ms=lease_ms,
            num_prior_output_tokens=req.num_tokens,
        ),
        metadata=req.metadata, timeout=req.time_remaining(),
    )
    decode.num_routed += 1
    try:
        pending: decode_pb2.DecodeResponse | None = None
        if not local:
            first, pending = await _remote_prefill(req, prompt, registry, call, decode)
            yield first
            if req.text.stopped:
                yield req.final(common_pb2.FINISH_REASON_STOP, None)
                return
        on_finished = (lambda t: router.observe(LEG_LOCAL, route, t.num_cached_prompt_tokens)) if local else None
        async for chunk in _decode_stream(req, call, decode, pending, on_finished):
            yield chunk
    finally:
        decode.num_routed -= 1
        call.cancel()


async def _remote_prefill(
    req: GatewayRequest, prompt: list[int], registry: Registry, call: grpc.aio.UnaryStreamCall,
    decode: WorkerEntry,
) -> tuple[gateway_pb2.GenerateResponse, decode_pb2.DecodeResponse | None]:
    """Wait for the reservation, run the prefill leg; the first token's chunk, plus a decode
    message that arrived meanwhile (or None)."""
    reserved = await _read(call, decode)
    if reserved is None or reserved.WhichOneof("event") != "reserved":
        raise LegFailed(decode, grpc.StatusCode.INTERNAL, "decode stream did not start with a reservation")
    route = registry.router.pick_prefill(req)
    if route is None:
        raise NoWorker("no live prefill worker")
    prefill = route.worker
    queue_us = int((time.monotonic() - req.start) * 1e6)
    num_uncached = len(prompt) - route.num_hit_tokens  # what it is expected to compute
    prefill.num_routed_prefill_tokens += num_uncached
    task = asyncio.ensure_future(prefill.stub.Prefill(  # type: ignore[attr-defined]
        prefill_pb2.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=prompt,
            sampling=req.validated.sampling, stopping=req.attempt_stopping,
            target=prefill_pb2.DecodeTarget(
                worker_id=decode.worker_id, address=decode.address,
                transfer_id=reserved.reserved.transfer_id, num_blocks=reserved.reserved.num_blocks,
                incarnation=reserved.reserved.incarnation, transfer_secret=reserved.reserved.transfer_secret,
            ),
            num_prior_output_tokens=req.num_tokens,
        ),
        metadata=req.metadata, timeout=req.time_remaining(),
    ))
    try:
        result, pending = await _await_prefill(task, prefill, call, decode)
    finally:
        prefill.num_routed_prefill_tokens -= num_uncached
        _discard(task)
    registry.router.observe(LEG_PREFILL, route, result.timings.num_cached_prompt_tokens)
    if req.timings is None:  # the first token's path (a migration keeps the original's)
        req.timings = common_pb2.PhaseTimings()
        req.timings.CopyFrom(result.timings)
        req.timings.queue_us = queue_us
    logprobs = [result.first_logprob] if result.HasField("first_logprob") else []
    return req.emit([result.first_token_id], logprobs), pending


async def _decode_stream(
    req: GatewayRequest, call: grpc.aio.UnaryStreamCall, decode: WorkerEntry,
    pending: decode_pb2.DecodeResponse | None,
    on_finished: Callable[[common_pb2.PhaseTimings], None] | None = None,
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Token chunks from the decode leg until it finishes (or a stop string matched);
    ``on_finished`` sees the decode worker's timings when it reports the finish."""
    while True:
        msg = pending if pending is not None else await _read(call, decode)
        pending = None
        if msg is None:
            raise LegFailed(decode, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a finish")
        kind = msg.WhichOneof("event")
        if kind == "tokens":
            if req.timings is None:  # local prefill: the first chunk ends the prefill
                req.timings = common_pb2.PhaseTimings()
            yield req.emit(list(msg.tokens.token_ids), list(msg.tokens.logprobs))
            if req.text.stopped:
                yield req.final(common_pb2.FINISH_REASON_STOP, None)
                return
        elif kind == "finished":
            if on_finished is not None:
                on_finished(msg.finished.timings)
            yield req.final(msg.finished.finish_reason, msg.finished.timings)
            return


async def _read(call: grpc.aio.UnaryStreamCall, worker: WorkerEntry) -> decode_pb2.DecodeResponse | None:
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise LegFailed(worker, exc.code(), exc.details() or "") from None
    return None if msg is grpc.aio.EOF else msg


async def _await_prefill(
    task: asyncio.Task[prefill_pb2.PrefillResponse], prefill: WorkerEntry,
    call: grpc.aio.UnaryStreamCall, decode: WorkerEntry,
) -> tuple[prefill_pb2.PrefillResponse, decode_pb2.DecodeResponse | None]:
    """Wait for the prefill leg while watching the decode leg: either failing cancels the other."""
    read_task = asyncio.ensure_future(_read(call, decode))
    try:
        done, _ = await asyncio.wait({task, read_task}, return_when=asyncio.FIRST_COMPLETED)
        if read_task in done and read_task.exception() is not None:
            exc = read_task.exception()
            if isinstance(exc, LegFailed) and not exc.connection_lost:
                # The decode worker is alive but gave up on the pages (lease, failed
                # receive): the prefill side is the one to avoid on the retry.
                raise LegFailed(prefill, exc.code, exc.details)
            raise exc  # type: ignore[misc]
        try:
            first = await task
        except grpc.aio.AioRpcError as exc:
            raise LegFailed(prefill, exc.code(), exc.details() or "") from None
        return first, await read_task
    finally:
        _discard(read_task)


def _discard(task: asyncio.Future) -> None:
    """Cancel ``task`` if it still runs; its outcome is taken either way, so a leg that
    failed after its sibling already decided the attempt is not reported as unretrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
