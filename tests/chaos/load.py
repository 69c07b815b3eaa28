"""Closed-loop load through the gateway: ``concurrency`` clients, each sending its next
request when the previous one ended, every stream recorded (status, tokens, text, client-side
TTFT, the longest gap between token chunks, whether it ran past its deadline)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc

from tests.chaos.workload import RequestSpec
from plumbing.resume import LOAD_BALANCING, ResumePolicy, gateway_target, generate_resumable
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc

HANG_SLACK_S = 5.0  # a call still open this long after its deadline is a hang
RESUME = ResumePolicy(max_retries=40, first_backoff_s=0.05, max_backoff_s=0.5)
# The client reconnects quickly after a gateway restart (gRPC's default backoff is 1 s, x1.6).
CLIENT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 500)]


@dataclass
class Outcome:
    spec: RequestSpec
    phase: str
    start: float  # monotonic
    end: float = 0.0
    code: str = "OK"
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_logprobs: int = 0
    finish_reason: int = 0
    migrations: int = 0
    resumes: int = 0  # continued on another stream (a gateway died): timings.resumes
    first_token_at: float | None = None
    max_gap_s: float = 0.0  # the longest wait between two token chunks
    hung: bool = False
    request_id: int = 0  # the gateway's (in its logs and the workers')

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start


def _stream(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, deadline_s: float,
            resume: bool) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    if resume:  # a broken stream goes on, on any gateway, from the tokens received
        return generate_resumable(stub, spec.to_proto(), timeout_s=deadline_s, policy=RESUME)
    return stub.Generate(spec.to_proto(), timeout=deadline_s)


async def one(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, deadline_s: float, phase: str,
              resume: bool = False) -> Outcome:
    out = Outcome(spec, phase, time.monotonic())
    call = _stream(stub, spec, deadline_s, resume)
    last = out.start
    try:
        async with asyncio.timeout(deadline_s + HANG_SLACK_S):
            async for chunk in call:
                now = time.monotonic()
                if chunk.token_ids:
                    if out.first_token_at is None:
                        out.first_token_at = now
                    else:
                        out.max_gap_s = max(out.max_gap_s, now - last)
                    last = now
                out.request_id = chunk.request_id
                out.token_ids += chunk.token_ids
                out.text += chunk.text
                out.num_logprobs += len(chunk.logprobs)
                if chunk.finish_reason:
                    out.finish_reason = chunk.finish_reason
                    out.migrations = chunk.timings.migrations
                    out.resumes = chunk.timings.resumes
    except grpc.RpcError as exc:  # a call's error, or the last one a resuming stream gave up on
        out.code, out.details = exc.code().name, exc.details() or ""
    except TimeoutError:
        await _close(call)
        out.code, out.hung = "HANG", True
    out.end = time.monotonic()
    return out


async def _close(call: object) -> None:
    if hasattr(call, "cancel"):
        call.cancel()
    else:
        await call.aclose()  # type: ignore[attr-defined]


async def drive(address: str, specs: Iterator[RequestSpec], concurrency: int, deadline_s: float,
                phase: str, keep_going: Callable[[int], bool], outcomes: list[Outcome], resume: bool = False) -> None:
    """Run ``concurrency`` closed-loop clients while ``keep_going(num_issued)``. ``address``:
    one gateway, or several (comma-separated IP:port), called round-robin."""
    issued = itertools.count()
    num_issued = 0

    async def client() -> None:
        nonlocal num_issued
        while keep_going(num_issued):
            num_issued = next(issued) + 1
            out = await one(stub, next(specs), deadline_s, phase, resume)
            outcomes.append(out)
            if out.code == "UNAVAILABLE" and not out.token_ids:
                await asyncio.sleep(0.1)  # the gateway is down or has no worker: do not spin

    async with grpc.aio.insecure_channel(gateway_target(address), options=CLIENT_OPTIONS + LOAD_BALANCING) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(client() for _ in range(concurrency)))
