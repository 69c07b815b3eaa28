"""The client side of resume (``plumbing/resume.py``, ``splitserve.client.GatewayClient``),
against scripted gateways on 127.0.0.1:0 that break their streams as a killed gateway does.

A scripted gateway streams SCRIPT from ``len(resume.token_ids)`` on, and refuses a resume whose
tokens are not SCRIPT's first ones or whose ``num_previous_resumes`` miscounts; it "dies" by
aborting with UNAVAILABLE "Socket closed" (or by ending without a final chunk) after a number
of chunks, on the calls its script says.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from plumbing import rpc
from plumbing.resume import LOAD_BALANCING, ResumableStream, ResumePolicy, generate_resumable, gateway_target
from splitserve.client import GatewayClient, make_request
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SCRIPT = list(range(100, 124))
FAST = ResumePolicy(max_retries=5, first_backoff_s=0.01, max_backoff_s=0.05)


class ScriptedGateway(gateway_pb2_grpc.GatewayServicer):
    """Call i (0-based) breaks after ``breaks[i]`` chunks ("end": ends OK without a final
    chunk; "after-final": aborts after its final chunk); calls past the list run to the end.
    Two tokens per chunk."""

    def __init__(self, breaks: list[int | str], code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.breaks = breaks
        self.code = code
        self.requests: list[gateway_pb2.GenerateRequest] = []

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: ANN201
        self.requests.append(request)
        plan = self.breaks[len(self.requests) - 1] if len(self.requests) <= len(self.breaks) else None
        n = len(request.resume.token_ids)
        if list(request.resume.token_ids) != SCRIPT[:n]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume.token_ids: not what was sent")
        end = request.stopping.max_new_tokens
        for i, pos in enumerate(range(n, end, 2)):
            if isinstance(plan, int) and i == plan:
                await context.abort(self.code, "Socket closed")
            if plan == "end" and i == 1:
                return
            yield gateway_pb2.GenerateResponse(token_ids=SCRIPT[pos : min(pos + 2, end)])
        yield gateway_pb2.GenerateResponse(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            timings=common_pb2.PhaseTimings(resumes=request.resume.num_previous_resumes + 1
                                            if request.HasField("resume") else 0))
        if plan == "after-final":  # killed between its final chunk and the stream's status
            await context.abort(self.code, "Socket closed")


async def _serve(gateways: list[ScriptedGateway]) -> tuple[list[grpc.aio.Server], str]:
    servers, addresses = [], []
    for gateway in gateways:
        server = rpc.make_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    return servers, ",".join(addresses)


def run_sync(gateways: list[ScriptedGateway], max_new_tokens: int = 12,
             policy: ResumePolicy = FAST) -> tuple[list[gateway_pb2.GenerateResponse], grpc.StatusCode | None]:
    """GatewayClient (blocking) against the scripted gateways, served on a loop in this thread
    between calls: the client runs in a worker thread."""
    async def main() -> tuple[list[gateway_pb2.GenerateResponse], grpc.StatusCode | None]:
        servers, target = await _serve(gateways)

        def client() -> tuple[list[gateway_pb2.GenerateResponse], grpc.StatusCode | None]:
            chunks: list[gateway_pb2.GenerateResponse] = []
            with GatewayClient(target, policy=policy) as c:
                try:
                    chunks.extend(c.generate(make_request([1, 2, 3], max_new_tokens), timeout_s=20))
                except grpc.RpcError as exc:
                    return chunks, exc.code()
            return chunks, None

        try:
            return await asyncio.to_thread(client)
        finally:
            for server in servers:
                await server.stop(0)
    return asyncio.run(main())


def tokens(chunks: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_broken_stream_continues_with_every_token_once() -> None:
    gateway = ScriptedGateway([2, 1])
    chunks, code = run_sync([gateway])
    assert code is None
    assert tokens(chunks) == SCRIPT[:12]
    assert chunks[-1].timings.resumes == 2
    sent = [list(r.resume.token_ids) for r in gateway.requests]
    assert sent == [[], SCRIPT[:4], SCRIPT[:6]]
    assert not gateway.requests[0].HasField("resume")
    assert [r.resume.num_previous_resumes for r in gateway.requests[1:]] == [0, 1]


def test_a_stream_that_ends_without_its_final_chunk_is_resumed() -> None:
    gateway = ScriptedGateway(["end"])
    chunks, code = run_sync([gateway])
    assert code is None and tokens(chunks) == SCRIPT[:12]
    assert list(gateway.requests[1].resume.token_ids) == SCRIPT[:2]


def test_a_cut_after_the_final_chunk_is_a_whole_reply_not_an_error() -> None:
    # A gateway killed after sending the final chunk but before the stream's OK: every token
    # arrived, so the request succeeded (found by the replicas' kill test); nothing is re-sent.
    gateway = ScriptedGateway(["after-final"])
    chunks, code = run_sync([gateway])
    assert code is None and tokens(chunks) == SCRIPT[:12] and chunks[-1].finish_reason
    assert len(gateway.requests) == 1

    async def main() -> list[gateway_pb2.GenerateResponse]:
        again = ScriptedGateway(["after-final"])
        servers, target = await _serve([again])
        async with grpc.aio.insecure_channel(gateway_target(target), options=LOAD_BALANCING) as channel:
            stream = generate_resumable(gateway_pb2_grpc.GatewayStub(channel), make_request([1], 8),
                                        timeout_s=20, policy=FAST)
            got = [c async for c in stream]
        for server in servers:
            await server.stop(0)
        assert len(again.requests) == 1
        return got
    assert tokens(asyncio.run(main())) == SCRIPT[:8]


def test_two_gateways_one_dying_every_time_it_is_called() -> None:
    """Round-robin over both addresses: whichever gets a call, the tokens come once."""
    flaky, healthy = ScriptedGateway([1, 1, 1, 1]), ScriptedGateway([])
    chunks, code = run_sync([flaky, healthy])
    assert code is None and tokens(chunks) == SCRIPT[:12]
    assert healthy.requests  # the survivor finished it
    assert chunks[-1].timings.resumes == len(flaky.requests) + len(healthy.requests) - 1


def test_retries_are_bounded() -> None:
    gateway = ScriptedGateway([0] * 10)
    chunks, code = run_sync([gateway], policy=ResumePolicy(max_retries=3, first_backoff_s=0.01, max_backoff_s=0.01))
    assert code == grpc.StatusCode.UNAVAILABLE and not chunks
    assert len(gateway.requests) == 4


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INTERNAL])
def test_other_errors_are_not_retried(code: grpc.StatusCode) -> None:
    gateway = ScriptedGateway([1], code=code)
    chunks, got = run_sync([gateway])
    assert got == code and tokens(chunks) == SCRIPT[:2] and len(gateway.requests) == 1


def test_the_async_driver_resumes_the_same_way() -> None:
    async def main() -> tuple[list[gateway_pb2.GenerateResponse], ScriptedGateway]:
        gateway = ScriptedGateway([3, 0, 2])
        servers, target = await _serve([gateway])
        async with grpc.aio.insecure_channel(gateway_target(target), options=LOAD_BALANCING) as channel:
            stream = generate_resumable(gateway_pb2_grpc.GatewayStub(channel), make_request([1], 16),
                                        timeout_s=20, policy=FAST)
            chunks = [c async for c in stream]
        for server in servers:
            await server.stop(0)
        return chunks, gateway
    chunks, gateway = asyncio.run(main())
    assert tokens(chunks) == SCRIPT[:16]
    # the second call broke before sending anything: it does not count as a resume
    assert [r.resume.num_previous_resumes for r in gateway.requests[1:]] == [0, 0, 1]
    assert chunks[-1].timings.resumes == 2


def test_the_deadline_bounds_the_retries() -> None:
    state = ResumableStream.start(make_request([1], 4), ResumePolicy(max_retries=100), timeout_s=0.02)
    time.sleep(0.03)
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    with pytest.raises(grpc.aio.AioRpcError):
        state.broke(error)


def test_gateway_target() -> None:
    assert gateway_target("gw:50051") == "gw:50051"
    assert gateway_target("dns:///gateway.ns.svc:50051") == "dns:///gateway.ns.svc:50051"
    assert gateway_target("127.0.0.1:1, 127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert gateway_target(["[::1]:1", "[::2]:2"]) == "ipv6:[::1]:1,[::2]:2"
    for bad, message in [("", "no gateway"), ("gw1:1,gw2:2", "one DNS name"), ("127.0.0.1:1,[::1]:2", "mixed"),
                         ("127.0.0.1:1,127.0.0.2:x", "no port")]:
        with pytest.raises(ValueError, match=message):
            gateway_target(bad)
    with pytest.raises(ValueError, match="max_retries"):
        ResumePolicy(max_retries=-1)


def test_http_front_flags_take_several_gateways_and_max_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from http_front.config import HttpConfig, add_http_flags, http_config

    def parse(*argv: str) -> HttpConfig:
        parser = argparse.ArgumentParser()
        add_http_flags(parser)
        return http_config(parser.parse_args(list(argv)))

    config = parse("--gateway", "127.0.0.1:1,127.0.0.2:2")
    assert gateway_target(config.gateway) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert config.resume == ResumePolicy(max_retries=20)
    monkeypatch.setenv("SPLITSERVE_MAX_RESUMES", "3")
    assert parse().resume.max_retries == 3
    with pytest.raises(ValueError, match="one DNS name"):
        HttpConfig(gateway="gw1:1,gw2:2")
    with pytest.raises(ValueError, match="max_retries"):
        HttpConfig(max_resumes=-1)
