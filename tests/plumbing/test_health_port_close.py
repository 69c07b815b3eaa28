"""The drain closes the health port last and lets the calls it has accepted be answered
(``plumbing/servers.py``): a kubelet probe that reached the port as it closed gets its answer,
not a cancellation (which grpc reports with a raw traceback on stderr)."""

from __future__ import annotations

import asyncio

import grpc

from plumbing.config import SecurityConfig
from plumbing.security import Security
from plumbing.servers import HEALTH, Servers


async def _slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.sleep(0.3)
    return b"answered:" + request


SLOW = grpc.method_handlers_generic_handler("test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(_slow)})


def test_a_call_in_flight_on_the_health_port_is_answered_by_the_drain() -> None:
    async def run() -> tuple[bytes | None, grpc.StatusCode | None, bool]:
        servers = Servers(Security.from_config(SecurityConfig()), lambda surface, reason: None)
        address = servers.add(HEALTH, "127.0.0.1", 0, [lambda server: server.add_generic_rpc_handlers((SLOW,))], [])
        await servers.start()
        async with grpc.aio.insecure_channel(address) as channel:
            call = asyncio.ensure_future(channel.unary_unary("/test.Slow/Call")(b"probe", timeout=10))
            await asyncio.sleep(0.1)  # the call is in its handler
            await servers.drain(0, 0)
            try:
                return await call, None, call.done()
            except grpc.aio.AioRpcError as error:
                return None, error.code(), call.done()

    answer, code, done = asyncio.run(run())
    assert (answer, code, done) == (b"answered:probe", None, True)
