"""Requests that do not parse (issue #10, item 5): every method of every service answers
INVALID_ARGUMENT, never UNKNOWN "Unexpected DecodeError", and the server keeps serving.

The servicers answer every method UNIMPLEMENTED: a request that parses reaches them, one that
does not is stopped by the interceptor of ``plumbing.rpc``, which the real services use,
before any handler runs.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from plumbing import rpc
from splitserve_api.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

SERVICES = [
    (gateway_pb2, "Gateway", gateway_pb2_grpc.add_GatewayServicer_to_server, gateway_pb2_grpc.GatewayServicer),
    (gateway_pb2, "WorkerRegistry", gateway_pb2_grpc.add_WorkerRegistryServicer_to_server,
     gateway_pb2_grpc.WorkerRegistryServicer),
    (decode_pb2, "DecodeWorker", decode_pb2_grpc.add_DecodeWorkerServicer_to_server,
     decode_pb2_grpc.DecodeWorkerServicer),
    (prefill_pb2, "PrefillWorker", prefill_pb2_grpc.add_PrefillWorkerServicer_to_server,
     prefill_pb2_grpc.PrefillWorkerServicer),
]
_rng = random.Random(10)
UNDECODABLE = {
    "random bytes": bytes(_rng.randrange(256) for _ in range(64)),
    "truncated": b"\x0a\x05ab",  # field 1, length 5, 2 bytes present
    "invalid utf-8": b"\x0a\x02\xff\xfe",  # field 1 as a string (where it is one) or a message
    "field number 0": b"\x00\x01",
}


def _unimplemented(module: object, name: str, base: type) -> object:
    """A servicer of ``name`` whose every method fails with UNIMPLEMENTED."""
    async def unary(self: object, request: object, context: object) -> None:
        raise rpc.ServiceError(grpc.StatusCode.UNIMPLEMENTED, "test servicer")

    async def streaming(self: object, request: object, context: object):  # noqa: ANN202
        raise rpc.ServiceError(grpc.StatusCode.UNIMPLEMENTED, "test servicer")
        yield  # an async generator, as the real streaming handlers

    service = module.DESCRIPTOR.services_by_name[name]  # type: ignore[attr-defined]
    methods = {m.name: streaming if m.server_streaming else unary for m in service.methods}
    return type(f"Unimplemented{name}", (base,), methods)()


def _methods() -> list[tuple[str, bool]]:
    """(full method path, server streaming) for every RPC of our four services."""
    out = []
    for module, name, _, _ in SERVICES:
        service = module.DESCRIPTOR.services_by_name[name]
        out += [(f"/{service.full_name}/{m.name}", m.server_streaming) for m in service.methods]
    return out


async def _call(channel: grpc.aio.Channel, method: str, streaming: bool, payload: bytes) -> grpc.StatusCode:
    try:
        if streaming:
            async for _ in channel.unary_stream(method)(payload, timeout=10):
                pass
        else:
            await channel.unary_unary(method)(payload, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_method_rejects_undecodable_bytes_with_invalid_argument() -> None:
    async def run() -> None:
        server = rpc.make_server()
        for module, name, add, base in SERVICES:
            add(_unimplemented(module, name, base), server)
        health = rpc.add_health_and_reflection(server, ["splitserve.v1.Gateway"])
        await rpc.set_serving(health, ["splitserve.v1.Gateway"], True)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            seen = {}
            for method, streaming in _methods() + [("/grpc.health.v1.Health/Check", False)]:
                for kind, payload in UNDECODABLE.items():
                    code = await _call(channel, method, streaming, payload)
                    if kind in ("random bytes", "truncated", "field number 0"):
                        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, kind, code)
                    seen[(method, kind)] = code
                # A message that parses reaches the (unimplemented) servicer: the check is the parse.
                if not method.startswith("/grpc.health"):
                    assert await _call(channel, method, streaming, b"") == grpc.StatusCode.UNIMPLEMENTED
            # Invalid UTF-8 is undecodable wherever field 1 is a string (prompt.text here).
            assert seen[("/splitserve.v1.Gateway/Generate", "invalid utf-8")] == grpc.StatusCode.INVALID_ARGUMENT
            assert grpc.StatusCode.UNKNOWN not in seen.values()
            # Reflection (a bidirectional stream) too, and the server still answers afterwards.
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")()
            await call.write(UNDECODABLE["random bytes"])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for r in replies for s in r.list_services_response.service]
            assert "splitserve.v1.Gateway" in names
            ok = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
        await server.stop(None)

    asyncio.run(run())
