"""The load generator: many concurrent ``Gateway.Generate`` streams on one ``grpc.aio`` loop.

Two ways to send (both seeded, both in one event loop, timestamps taken client-side with
``time.perf_counter`` as each chunk arrives):

* **closed loop**: ``concurrency`` clients, each sending its next request when the previous
  one ended, until the requests run out (or ``stop`` is set);
* **open loop**: requests arrive as a Poisson process at ``rate_rps`` (exponential gaps from
  ``random.Random(seed)``), whether or not earlier ones finished.

Every request is greedy and ignores EOS (see ``bench.workload``). A failed stream is
recorded with its gRPC status, never raised: the run goes on and the report counts it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from bench.metrics import RequestRecord, ServerTimings
from bench.workload import RequestSpec

OnDone = Callable[[RequestRecord], None]


@dataclass(frozen=True)
class LoadPlan:
    """How one run sends its requests."""

    mode: str  # "closed" or "open"
    concurrency: int = 1  # closed loop
    rate_rps: float = 0.0  # open loop
    seed: int = 0  # open loop: the arrival times

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.mode == "open" and not self.rate_rps > 0:
            raise ValueError(f"rate_rps must be > 0, got {self.rate_rps}")

    def describe(self) -> str:
        if self.mode == "closed":
            return f"closed loop, {self.concurrency} clients"
        return f"open loop, Poisson {self.rate_rps:.3g} req/s"

    def to_dict(self) -> dict:
        if self.mode == "closed":
            return {"mode": "closed", "concurrency": self.concurrency}
        return {"mode": "open", "rate_rps": self.rate_rps, "seed": self.seed}


def poisson_offsets(num_requests: int, rate_rps: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process; the first arrives at 0."""
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate_rps)
    return offsets


def _server_timings(timings: object) -> ServerTimings:
    return ServerTimings(**{name: int(getattr(timings, name)) for name in ServerTimings.__dataclass_fields__})


class LoadGenerator:
    """Sends requests over one channel to a gateway. Use as ``async with``."""

    def __init__(self, address: str, timeout_s: float = 600.0, keep_token_ids: bool = False) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.keep_token_ids = keep_token_ids
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    async def __aenter__(self) -> LoadGenerator:
        from plumbing.rpc import channel_options
        from splitserve_api.v1 import gateway_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.address, options=channel_options())
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def send(self, index: int, spec: RequestSpec) -> RequestRecord:
        """One streamed request, timed chunk by chunk."""
        from splitserve.client import make_request

        request = make_request(list(spec.prompt_token_ids), spec.max_new_tokens, temperature=0.0,
                               ignore_eos=True)
        times: list[float] = []
        counts: list[int] = []
        token_ids: list[int] = []
        server, error = None, None
        send = time.perf_counter()
        try:
            async for chunk in self._stub.Generate(request, timeout=self.timeout_s):
                now = time.perf_counter()
                if chunk.token_ids:
                    times.append(now)
                    counts.append(len(chunk.token_ids))
                    if self.keep_token_ids:
                        token_ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    server = _server_timings(chunk.timings)
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        end = time.perf_counter()
        return RequestRecord(index=index, kind=spec.kind, num_prompt_tokens=len(spec.prompt_token_ids),
                             send_s=send, chunk_times_s=tuple(times), chunk_num_tokens=tuple(counts),
                             end_s=end, error=error, server=server, token_ids=tuple(token_ids))

    async def closed_loop(self, requests: Sequence[RequestSpec], concurrency: int,
                          stop: asyncio.Event | None = None, on_done: OnDone | None = None,
                          first_index: int = 0) -> list[RequestRecord]:
        """``concurrency`` clients take the requests in order, one at a time each."""
        pending = iter(enumerate(requests, start=first_index))
        records: list[RequestRecord] = []

        async def client() -> None:
            for index, spec in pending:
                if stop is not None and stop.is_set():
                    return
                record = await self.send(index, spec)
                records.append(record)
                if on_done is not None:
                    on_done(record)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return sorted(records, key=lambda r: r.index)

    async def open_loop(self, requests: Sequence[RequestSpec], rate_rps: float, seed: int,
                        on_done: OnDone | None = None, first_index: int = 0) -> list[RequestRecord]:
        """Each request starts at its Poisson arrival time, independent of the others."""
        start = time.perf_counter()
        tasks = []
        for i, (spec, offset) in enumerate(zip(requests, poisson_offsets(len(requests), rate_rps, seed))):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(self.send(first_index + i, spec))
            if on_done is not None:
                task.add_done_callback(lambda t: on_done(t.result()))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))

    async def run(self, requests: Sequence[RequestSpec], plan: LoadPlan,
                  on_done: OnDone | None = None) -> list[RequestRecord]:
        if plan.mode == "closed":
            return await self.closed_loop(requests, plan.concurrency, on_done=on_done)
        return await self.open_loop(requests, plan.rate_rps, plan.seed, on_done=on_done)
