"""Admission that holds (issue #22, items 5 and 6).

* ``--max-in-flight N`` under 10 × N concurrent requests: the count was checked, then the
  tokenizer awaited, then the count taken, so concurrent requests all passed the check. Now
  the gauge never exceeds N (it is observed at every change), exactly N are served and the
  rest get RESOURCE_EXHAUSTED.
* A local prefill under pool exhaustion waited for the client's deadline; it now waits in the
  remote prefill's reservation queue and gets RESOURCE_EXHAUSTED after its
  ``reservation_wait_ms`` like a remote one (the pool's blocks held by another reservation).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine import SamplingParams
from gateway.registry import Registry
from gateway.service import GatewayService
from gateway.validation import Limits
from plumbing import rpc
from plumbing.config import GatewayConfig, ServerConfig
from plumbing.metrics import GatewayMetrics
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.decode_worker.test_kv_inbox import Harness

N = 3
LIMITS = Limits(vocab_size=100, max_model_len=64, max_stop_strings=8, max_stop_string_bytes=256, bytes_per_token=4)


class Tokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [5, 6, 7]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class GaugeWatch:
    """Wraps the in-flight gauge: records its value after every change."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.gauge = metrics.in_flight
        self.seen: list[float] = []
        inc, dec = self.gauge.inc, self.gauge.dec
        self.gauge.inc = lambda *a: (inc(*a), self.seen.append(self.value))  # type: ignore[method-assign]
        self.gauge.dec = lambda *a: (dec(*a), self.seen.append(self.value))  # type: ignore[method-assign]

    @property
    def value(self) -> float:
        return self.gauge._value.get()  # noqa: SLF001 - the gauge's value


def test_max_in_flight_holds_under_ten_times_as_many_concurrent_requests() -> None:
    async def run() -> None:
        metrics = GatewayMetrics.create()
        watch = GaugeWatch(metrics)
        service = GatewayService(GatewayConfig(server=ServerConfig(), model="m", max_in_flight=N),
                                 Registry("m", 500, 3), Tokenizer(), LIMITS, metrics, "m")
        release = asyncio.Event()

        async def held(req: object) -> AsyncIterator[gateway_pb2.GenerateResponse]:
            await release.wait()  # an admitted request holds its place until the test lets go
            yield gateway_pb2.GenerateResponse(token_ids=[9], finish_reason=common_pb2.FINISH_REASON_LENGTH)

        service._with_retries = held  # type: ignore[method-assign]
        server = rpc.make_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            calls = [asyncio.ensure_future(stub.GenerateUnary(make_request("hi", 1), timeout=60))
                     for _ in range(10 * N)]
            for _ in range(3000):  # bounded: until every request past the cap was refused
                if sum(c.done() for c in calls) == 9 * N:
                    break
                await asyncio.sleep(0.01)
            release.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
        await server.stop(0)
        served = [r for r in results if isinstance(r, gateway_pb2.GenerateResponse)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(served) == N and len(refused) == 9 * N
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_in_flight=3" in r.details() for r in refused)
        assert max(watch.seen) == N and watch.value == 0 and service.num_in_flight == 0
        service.close()

    asyncio.run(run())


def test_a_local_prefill_waits_in_the_reservation_queue_and_is_refused_after_its_wait() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())  # 64 blocks
        bs = h.engine.kv.block_size
        holders = [await h.reserve(str(i), 20 * bs) for i in (100, 101, 102)]  # 60 blocks reserved
        prompt = list(range(5, 5 + 8 * bs))  # needs 8 blocks: more than are free
        waited = h.table.request_local(h.engine, "2", prompt, SamplingParams(max_tokens=2), wait_s=0.3)
        for _ in range(100):  # the engine thread's ticks (the loop plays it here)
            if waited.done():
                break
            h.table.serve_waiters(h.engine)
            await asyncio.sleep(0.01)
        assert await waited is None  # the service turns this into RESOURCE_EXHAUSTED
        assert not h.engine.scheduler.is_known("2")  # never queued in the engine
        queued = h.table.request_local(h.engine, "3", prompt, SamplingParams(max_tokens=2), wait_s=30)
        await asyncio.sleep(0.05)
        assert not queued.done()  # still waiting for room
        h.table.forget(h.engine, "100", "the stream ended")  # a holder's blocks free up
        h.table.serve_waiters(h.engine)
        assert await asyncio.wait_for(queued, 10) is True and h.engine.scheduler.is_known("3")
        assert holders[0].transfer_id not in h.table.pending
        for rid in ("101", "102"):
            h.table.forget(h.engine, rid, "the stream ended")
        h.engine.abort("3")
        h.engine.check_integrity()
        assert h.engine.num_free_blocks == h.engine.kv.num_blocks

    asyncio.run(run())
