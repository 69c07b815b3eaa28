"""One routing attempt of a request: the decode leg and, for a remote prefill, the prefill leg::

    pick decode worker (gateway/routing.py) ── Decode(stream) ──▶ Reservation{num_cached_blocks}  (remote prefill)
    pick prefill worker (gateway/routing.py) ── Prefill ──▶ its timings, once its last page is sent
    Decode stream ──▶ FirstToken (when the transfer is announced) ──▶ TokenChunk … DecodeFinished

A straight pipeline: every token, the first included, comes from the decode stream and goes
to the client as it comes, each once. The prefill call's answer says two things only: whether
it failed and what it cost (its timings). While it runs, each read of the decode stream also
watches it (``Legs.next``), so a prefill that fails fails the attempt at once, before or after
the first token (the service then retries, or migrates with the tokens sent counted), and a
decode stream that fails (but for a lost connection) blames the prefill worker. The final
chunk waits for the answer (``Legs.prefill_timings``): the prefill answers once its last page
is sent, which the decode side needs before it can admit, so this wait is short; the call's
deadline (the client's) bounds it, and a prefill that fails then changes nothing, every token
being out. The attempt that sent the request's first token owns the request's timings
(``GatewayRequest.timings``): its queue time and its prefill's answer; a migration keeps them.

Prompts shorter than ``local_prefill_max_tokens`` (with prefix routing: whose part the
decode worker does not hold is that short, or that worker holds most of the prompt), or any
prompt when no prefill worker is alive, are prefilled by the decode worker itself
(``Router.prefill_locally``). A migration (an attempt after tokens were sent) routes and
prefills the prompt plus those tokens the same way, with the budgets that are left. A leg
that fails cancels the other (the workers free their blocks in their handlers' ``finally``)
and raises ``LegFailed`` naming the worker to blame; the service decides whether to retry.

A lost connection is told by its status and by who answered, never by the error's text: an
UNAVAILABLE that the worker's own process sent carries its incarnation in the trailing
metadata (``INCARNATION_KEY``); one without it (the connection broke, nobody answered) or
with another incarnation (a restarted process at that address) means the worker registered
is gone. A DEADLINE_EXCEEDED from a worker while the client's own deadline still has time
is an internal deadline: it is retried as UNAVAILABLE, never shown to the client as its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import structlog

from gateway.admission import PrefillAdmission, Ticket
from gateway.registry import Registry
from gateway.workers import WorkerEntry
from gateway.request import GatewayRequest
from gateway.routing import LEG_LOCAL, LEG_PREFILL
from plumbing.channels import ChannelClosed
from plumbing.rpc import INCARNATION_KEY
from splitserve_api.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2

log = structlog.get_logger()

MIN_CLIENT_TIME_S = 0.05  # a worker's DEADLINE_EXCEEDED with less client time left than this is the client's


class LegFailed(Exception):
    """A worker leg failed before the request finished."""

    def __init__(self, worker: WorkerEntry, code: grpc.StatusCode, details: str,
                 answered_by: int | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.worker = worker
        self.code = code
        self.details = details
        self.answered_by = answered_by  # the incarnation that sent the error (None: nobody did)

    @property
    def connection_lost(self) -> bool:
        """The registered process is gone: UNAVAILABLE that it did not send itself."""
        return self.code == grpc.StatusCode.UNAVAILABLE and self.answered_by != self.worker.incarnation

    @classmethod
    def of(cls, worker: WorkerEntry, exc: grpc.aio.AioRpcError, req: GatewayRequest) -> LegFailed:
        """The failure of a call to ``worker``, an internal deadline counted as UNAVAILABLE."""
        code, details = exc.code(), exc.details() or ""
        remaining = req.time_remaining()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > MIN_CLIENT_TIME_S):
            code, details = grpc.StatusCode.UNAVAILABLE, f"a worker's internal deadline passed: {details}"
        return cls(worker, code, details, _incarnation(exc))

    @classmethod
    def closed_channel(cls, worker: WorkerEntry, exc: Exception) -> LegFailed:
        """A call on a channel the registry already closed (``ChannelClosed``, or grpc's
        ``UsageError``): the worker was dropped while the request waited (at the prefill
        gate) with nothing routed to it yet. A lost worker."""
        return cls(worker, grpc.StatusCode.UNAVAILABLE, f"its channel is closed: {exc}")


def _incarnation(exc: grpc.aio.AioRpcError) -> int | None:
    for key, value in exc.trailing_metadata() or ():
        if key == INCARNATION_KEY and isinstance(value, str) and value.isdigit():
            return int(value)
    return None


class NoWorker(Exception):
    """No live worker of a needed role is left to try."""


async def attempt(req: GatewayRequest, registry: Registry, local_prefill_max_tokens: int,
                  reservation_wait_ms: int, lease_ms: int,
                  admission: PrefillAdmission | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Route ``req`` once and stream its chunks; LegFailed / NoWorker on failure. A remote
    prefill first waits for room in the prefill pool (``admission``), before anything is reserved."""
    router = registry.router
    route = router.pick_decode(req)
    if route is None:
        raise NoWorker("no live decode worker")
    decode = route.worker
    prompt = req.attempt_prompt
    local = router.prefill_locally(req, route, local_prefill_max_tokens,
                                   admission.passing_tokens if admission is not None else 0)
    ticket: Ticket | None = None
    if not local and admission is not None:
        ticket = await admission.enter(len(prompt), req.time_remaining())
    try:
        call = decode.stub.Decode(  # type: ignore[attr-defined]
            decode_pb2.DecodeRequest(
                request_id=req.request_id, prompt_token_ids=prompt, sampling=req.validated.sampling,
                stopping=req.attempt_stopping,
                prefill_mode=decode_pb2.PREFILL_MODE_LOCAL if local else decode_pb2.PREFILL_MODE_REMOTE,
                reservation_wait_ms=reservation_wait_ms, lease_ms=lease_ms,
                num_prior_output_tokens=req.num_tokens, constraint=req.validated.constraint,
            ),
            metadata=req.metadata, timeout=req.time_remaining(),
        )
    except (ChannelClosed, grpc.aio.UsageError) as exc:
        if ticket is not None:
            ticket.close()  # the pool's room goes back, or the gate stays short of it for good
        raise LegFailed.closed_channel(decode, exc) from None
    decode.num_routed += 1
    # A local prompt counts in the decode worker's queue (routing.queued_prefill_tokens)
    # until its first token: routing's spill rule compares it with the prefill pool's. No
    # await since prefill_locally, so the next request routed sees it.
    local_tokens = len(prompt) - route.num_hit_tokens if local else 0
    decode.num_routed_prefill_tokens += local_tokens
    legs = Legs(req, call, decode)
    try:
        if not local:
            legs.prefill = await _start_prefill(req, prompt, registry, legs)
            if ticket is not None:
                ticket.close()  # its tokens now count as routed to the prefill worker
        on_finished = (lambda t: router.observe(LEG_LOCAL, route, t.num_cached_prompt_tokens)) if local else None
        async for chunk in _decode_stream(req, legs, on_finished):
            decode.num_routed_prefill_tokens -= local_tokens
            local_tokens = 0
            yield chunk
    finally:
        decode.num_routed -= 1
        decode.num_routed_prefill_tokens -= local_tokens
        if ticket is not None:
            ticket.close()
        call.cancel()
        legs.close()


@dataclass(eq=False)
class PrefillLeg:
    """A running ``Prefill`` call and what the gateway charged to its worker."""

    task: asyncio.Task[prefill_pb2.PrefillResponse]
    worker: WorkerEntry
    queue_us: int  # from the request's start to this call
    observe: Callable[[prefill_pb2.PrefillResponse], None]  # its answer's routing observation
    release: Callable[[], None]  # gives back the routed prompt tokens, once
    timings: common_pb2.PhaseTimings | None = None  # its answer's, once it answered OK


class Legs:
    """One attempt's decode stream and, while it runs, its prefill call: ``next`` reads the
    stream and watches the call, so either failing fails the attempt at once."""

    def __init__(self, req: GatewayRequest, call: grpc.aio.UnaryStreamCall, decode: WorkerEntry) -> None:
        self.req = req
        self.call = call
        self.decode = decode
        self.prefill: PrefillLeg | None = None
        self._read: asyncio.Future[decode_pb2.DecodeResponse | None] | None = None
        self._timings_due = False  # this attempt sent the request's first token; its prefill's timings are to come

    async def next(self) -> decode_pb2.DecodeResponse | None:
        """The decode stream's next message (None at its end). LegFailed names the worker to
        blame: the prefill worker when its call failed, or when the stream failed (but for a
        lost connection) while the call still ran."""
        read = self._read or asyncio.ensure_future(_read(self.call, self.decode, self.req))
        self._read = None
        leg = self.prefill
        if leg is not None and leg.timings is None:
            self._read = read  # close() discards it if the wait below raises
            await asyncio.wait({leg.task, read}, return_when=asyncio.FIRST_COMPLETED)
            if leg.task.done():
                self._settle(leg)  # LegFailed(prefill worker) if the call failed
            elif isinstance(read.exception(), LegFailed) and not read.exception().connection_lost:
                # The decode worker is alive but gave up on the pages (lease, failed
                # receive): the prefill side is the one to avoid on the retry.
                exc = read.exception()
                raise LegFailed(leg.worker, exc.code, exc.details, leg.worker.incarnation)
            self._read = None
        return await read

    def start_timings(self) -> None:
        """The decode stream told this request's first token: the request's timings start
        here (queue time; a remote prefill's answer fills in the rest)."""
        leg = self.prefill
        self.req.timings = common_pb2.PhaseTimings(queue_us=leg.queue_us if leg is not None else 0)
        self._timings_due = leg is not None
        self._take_timings()

    async def prefill_timings(self) -> None:
        """Before the final chunk: the prefill's answer, when it has not come yet (bounded by
        the call's deadline, the client's). A prefill that fails now changes nothing, every
        token being out: the timings then lack its part."""
        leg = self.prefill
        if leg is None or leg.timings is not None:
            return
        await asyncio.wait({leg.task})
        try:
            self._settle(leg)
        except LegFailed as exc:
            log.info("request.prefill_failed_after_finish", worker_id=leg.worker.worker_id, code=exc.code.name)

    def _settle(self, leg: PrefillLeg) -> None:
        leg.release()
        try:
            result = leg.task.result()
        except grpc.aio.AioRpcError as exc:
            raise LegFailed.of(leg.worker, exc, self.req) from None
        except grpc.aio.UsageError as exc:
            raise LegFailed.closed_channel(leg.worker, exc) from None
        except asyncio.CancelledError:
            raise LegFailed(leg.worker, grpc.StatusCode.CANCELLED, "prefill call cancelled") from None
        leg.timings = result.timings
        leg.observe(result)
        self._take_timings()

    def _take_timings(self) -> None:
        leg = self.prefill
        if self._timings_due and leg is not None and leg.timings is not None and self.req.timings is not None:
            self.req.timings.CopyFrom(leg.timings)
            self.req.timings.queue_us = leg.queue_us
            self._timings_due = False

    def close(self) -> None:
        if self._read is not None:
            _discard(self._read)
        if self.prefill is not None:
            self.prefill.release()
            _discard(self.prefill.task)


async def _start_prefill(req: GatewayRequest, prompt: list[int], registry: Registry, legs: Legs) -> PrefillLeg:
    """Wait for the reservation, then start the prefill leg on the worker routing picks."""
    decode = legs.decode
    reserved = await _read(legs.call, decode, req)
    if reserved is None or reserved.WhichOneof("event") != "reserved":
        raise LegFailed(decode, grpc.StatusCode.INTERNAL, "decode stream did not start with a reservation")
    route = registry.router.pick_prefill(req)
    if route is None:
        raise NoWorker("no live prefill worker")
    prefill = route.worker
    queue_us = int((time.monotonic() - req.start) * 1e6)
    num_uncached = len(prompt) - route.num_hit_tokens  # what it is expected to compute
    prefill.num_routed_prefill_tokens += num_uncached
    r = reserved.reserved
    try:
        call = prefill.stub.Prefill(  # type: ignore[attr-defined]
            prefill_pb2.PrefillRequest(
                request_id=req.request_id, prompt_token_ids=prompt,
                sampling=req.validated.sampling, stopping=req.attempt_stopping,
                target=prefill_pb2.DecodeTarget(
                    worker_id=decode.worker_id, address=decode.address, transfer_id=r.transfer_id,
                    num_blocks=r.num_blocks, incarnation=r.incarnation, transfer_secret=r.transfer_secret,
                    num_cached_blocks=r.num_cached_blocks,
                ),
                num_prior_output_tokens=req.num_tokens, constraint=req.validated.constraint,
            ),
            metadata=req.metadata, timeout=req.time_remaining(),
        )
    except (ChannelClosed, grpc.aio.UsageError) as exc:
        prefill.num_routed_prefill_tokens -= num_uncached
        raise LegFailed.closed_channel(prefill, exc) from None
    task = asyncio.ensure_future(call)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            prefill.num_routed_prefill_tokens -= num_uncached

    def observe(result: prefill_pb2.PrefillResponse) -> None:
        registry.router.observe(LEG_PREFILL, route, result.timings.num_cached_prompt_tokens)

    return PrefillLeg(task, prefill, queue_us, observe, release)


async def _decode_stream(
    req: GatewayRequest, legs: Legs,
    on_finished: Callable[[common_pb2.PhaseTimings], None] | None = None,
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Token chunks (a remote prefill's first token first) until the decode leg finishes (or
    a stop string matched); ``on_finished`` sees the decode worker's timings when it reports
    the finish. The final chunk waits for the prefill's timings."""
    while True:
        msg = await legs.next()
        if msg is None:
            raise LegFailed(legs.decode, grpc.StatusCode.UNAVAILABLE, "decode stream ended without a finish",
                            legs.decode.incarnation)
        kind = msg.WhichOneof("event")
        if kind in ("first_token", "tokens"):
            if req.timings is None:  # this request's first token (a migration keeps the original's timings)
                legs.start_timings()
            if kind == "first_token":
                first = msg.first_token
                yield req.emit([first.token_id], [first.logprob] if first.HasField("logprob") else [])
            else:
                yield req.emit(list(msg.tokens.token_ids), list(msg.tokens.logprobs))
        elif kind == "finished":
            if on_finished is not None:
                on_finished(msg.finished.timings)
            await legs.prefill_timings()
            yield req.final(msg.finished.finish_reason, msg.finished.timings)
            return
        else:
            continue
        if req.text.stopped:
            await legs.prefill_timings()
            yield req.final(common_pb2.FINISH_REASON_STOP, None)
            return


async def _read(call: grpc.aio.UnaryStreamCall, worker: WorkerEntry,
                req: GatewayRequest) -> decode_pb2.DecodeResponse | None:
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise LegFailed.of(worker, exc, req) from None
    except grpc.aio.UsageError as exc:
        raise LegFailed.closed_channel(worker, exc) from None
    return None if msg is grpc.aio.EOF else msg


def _discard(task: asyncio.Future) -> None:
    """Cancel ``task`` if it still runs; its outcome is taken either way, so a leg that
    failed after its sibling already decided the attempt is not reported as unretrieved."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
