"""The load generator against a fake gateway (grpc.aio on 127.0.0.1:0): what it records, how
many requests it keeps in flight, how it reports failures. No timing assertions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc
import pytest

from bench.deployment import WARMUP, send_all
from bench.loadgen import LoadGenerator, LoadPlan, poisson_offsets
from bench.metrics import Slo
from bench.online import measure
from bench.workload import RequestSpec
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

BAD_TOKEN = 0  # the fake rejects prompts that start with it


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams ``max_new_tokens`` tokens (token i = prompt length + i), two per chunk after the
    first, then a final chunk with fixed timings; counts concurrent streams."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.num_calls = 0

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self.num_calls += 1
        prompt = list(request.token_ids.ids)
        if prompt[0] == BAD_TOKEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: bad token")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            tokens = [len(prompt) + i for i in range(request.stopping.max_new_tokens)]
            chunks = [tokens[:1]] + [tokens[i:i + 2] for i in range(1, len(tokens), 2)]
            for chunk in chunks:
                await asyncio.sleep(0.002)
                yield gateway_pb2.GenerateResponse(request_id=1, token_ids=chunk)
            yield gateway_pb2.GenerateResponse(
                request_id=1, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                timings=common_pb2.PhaseTimings(transfer_us=500, transfer_bytes=4096, first_token_us=10,
                                                total_us=100, num_draft_tokens=4, num_accepted_tokens=3),
                num_prompt_tokens=len(prompt))
        finally:
            self.in_flight -= 1

    async def GetInfo(self, request: gateway_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> gateway_pb2.GetInfoResponse:
        return gateway_pb2.GetInfoResponse(model="fake", max_model_len=512, vocab_size=100)


async def _serve(fake: FakeGateway) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _requests(n: int, max_new_tokens: int = 5) -> list[RequestSpec]:
    return [RequestSpec(tuple(range(3, 3 + 4 + i)), max_new_tokens, "test") for i in range(n)]


def test_closed_loop_records_every_chunk_and_respects_concurrency() -> None:
    fake = FakeGateway()

    async def go():
        server, address = await _serve(fake)
        try:
            async with LoadGenerator(address, keep_token_ids=True) as gen:
                return await gen.closed_loop(_requests(7), concurrency=2)
        finally:
            await server.stop(None)

    records = asyncio.run(go())
    assert [r.index for r in records] == list(range(7))
    assert fake.num_calls == 7 and fake.max_in_flight <= 2
    for i, record in enumerate(records):
        assert record.ok and record.error is None
        assert record.num_prompt_tokens == 4 + i
        assert record.chunk_num_tokens == (1, 2, 2)           # 5 tokens: 1 + 2 + 2
        assert record.token_ids == tuple(range(4 + i, 9 + i))
        assert record.send_s < record.chunk_times_s[0] <= record.chunk_times_s[-1] <= record.end_s
        assert record.server.transfer_bytes == 4096 and record.server.num_accepted_tokens == 3


def test_open_loop_sends_all_in_arrival_order_and_records_failures() -> None:
    fake = FakeGateway()
    reqs = _requests(5)
    reqs[2] = RequestSpec((BAD_TOKEN, 5, 6), 5, "bad")

    async def go():
        server, address = await _serve(fake)
        try:
            async with LoadGenerator(address) as gen:
                return await gen.run(reqs, LoadPlan("open", rate_rps=200.0, seed=1))
        finally:
            await server.stop(None)

    records = asyncio.run(go())
    assert [r.index for r in records] == list(range(5))
    sends = [r.send_s for r in records]
    assert sends == sorted(sends)
    assert not records[2].ok and records[2].error.startswith("INVALID_ARGUMENT")
    assert records[2].num_output_tokens == 0
    assert all(r.ok for i, r in enumerate(records) if i != 2)


def test_closed_loop_stops_issuing_when_told() -> None:
    fake = FakeGateway()

    async def go():
        server, address = await _serve(fake)
        stop = asyncio.Event()
        stop.set()
        try:
            async with LoadGenerator(address) as gen:
                return await gen.closed_loop(_requests(4), concurrency=2, stop=stop)
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == []
    assert fake.num_calls == 0


@contextmanager
def served_from_a_thread(fake: FakeGateway) -> Iterator[str]:
    """The fake on its own event loop in a thread, for callers that run their own loop."""
    loop = asyncio.new_event_loop()
    server, address = loop.run_until_complete(_serve(fake))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_measure_builds_a_report_entry() -> None:
    fake = FakeGateway()
    with served_from_a_thread(fake) as address:
        entry, records = measure(address, "run", "synthetic", _requests(4), LoadPlan("closed", concurrency=4),
                                 Slo(ttft_s=10.0, tpot_s=10.0), progress=False)
    assert len(records) == 4 and entry["counts"]["num_completed"] == 4
    figures = entry["figures"]
    assert figures["goodput_rps"] == figures["requests_per_s"] > 0   # generous SLOs
    assert figures["kv_transfer_kib"]["p50"] == 4.0
    assert figures["spec_decode_acceptance_rate"] == 0.75
    assert figures["kv_utilisation"] == {"decode": {"skipped": "no KV samples were taken"}}
    assert [row["num_output_tokens"] for row in entry["requests"]] == [5, 5, 5, 5]


def test_send_all_warms_up_then_times_every_request_in_order() -> None:
    fake = FakeGateway()
    with served_from_a_thread(fake) as address:
        seconds, records = send_all(address, _requests(5, max_new_tokens=3))
    assert fake.num_calls == 2 + 5  # the untimed warm-ups are not in the records
    assert [r.index for r in records] == list(range(5))
    assert [r.token_ids for r in records] == [tuple(range(4 + i, 7 + i)) for i in range(5)]
    assert seconds == max(r.end_s for r in records) - min(r.send_s for r in records) > 0
    assert len(WARMUP.prompt_token_ids) == 16 and WARMUP.kind == "warmup"


def test_send_all_raises_on_a_failed_request() -> None:
    fake = FakeGateway()
    reqs = _requests(3)
    reqs[1] = RequestSpec((BAD_TOKEN, 5, 6), 5, "bad")
    with served_from_a_thread(fake) as address, pytest.raises(RuntimeError, match="1 request.*INVALID_ARGUMENT"):
        send_all(address, reqs, concurrency=1)


def test_poisson_offsets_are_seeded() -> None:
    offsets = poisson_offsets(2000, rate_rps=4.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == poisson_offsets(2000, rate_rps=4.0, seed=3)
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert 0.2 < mean_gap < 0.3  # 1 / rate = 0.25


def test_load_plan_validation() -> None:
    with pytest.raises(ValueError):
        LoadPlan("open")
    with pytest.raises(ValueError):
        LoadPlan("closed", concurrency=0)
    with pytest.raises(ValueError):
        LoadPlan("burst")
