"""Tokens on the public and internal surfaces (``plumbing/auth.py``): UNAUTHENTICATED and
counted when missing or wrong, accepted when right, never logged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.auth import TokenSet, presented_token
from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.config import SecurityConfig
from plumbing.metrics import GatewayMetrics
from plumbing.security import Security
from plumbing.servers import INTERNAL, PUBLIC, Servers

KEY, OTHER_KEY, SECRET = "sk-test-Zq81vX0pL2", "sk-test-second-77aa", "internal-secret-4NfQ"


def test_token_set_reads_a_file_and_a_value_and_reloads(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# API keys\n\n{KEY}\n")
    tokens = TokenSet("api_keys", file=str(keys), inline=f" {OTHER_KEY} ,")
    assert tokens.accepts(KEY) and tokens.accepts(OTHER_KEY)
    for wrong in ("", KEY[:-1], KEY + "x", "# API keys", KEY.upper()):
        assert not tokens.accepts(wrong), wrong
    keys.write_text("sk-rotated\n")
    assert tokens.reload() and tokens.accepts("sk-rotated") and not tokens.accepts(KEY)
    assert tokens.accepts(OTHER_KEY)  # the value's keys stay
    only_file = TokenSet("api_keys", file=str(keys))
    keys.write_text("")  # an emptied file keeps the old keys rather than locking everyone out
    assert only_file.reload() is False and only_file.accepts("sk-rotated")
    with pytest.raises(ValueError, match="api_keys: no token given"):
        TokenSet("api_keys", file=str(keys))
    with pytest.raises(ValueError, match="without spaces"):
        TokenSet("api_keys", inline="two words")


def test_presented_token() -> None:
    assert presented_token((("authorization", f"Bearer {KEY}"),)) == KEY
    assert presented_token((("authorization", f"bearer {KEY}"),)) == KEY
    assert presented_token((("x-api-key", KEY),)) == KEY
    assert presented_token((("authorization", f"Basic {KEY}"),)) is None
    assert presented_token((("authorization", "Bearer "),)) is None
    assert presented_token(None) is None


ECHO = grpc.method_handlers_generic_handler("test.Echo", {
    "Say": grpc.unary_unary_rpc_method_handler(lambda request, context: _say(request)),
    "Stream": grpc.unary_stream_rpc_method_handler(lambda request, context: _stream(request)),
})


async def _say(request: bytes) -> bytes:
    return b"said:" + request


async def _stream(request: bytes):  # noqa: ANN202
    for i in range(3):
        yield bytes([i])


async def _serve(surface: str, config: SecurityConfig, metrics: GatewayMetrics) -> tuple[Servers, str]:
    servers = Servers(Security.from_config(config), metrics.count_auth_failure)
    address = servers.add(surface, "127.0.0.1", 0, [lambda server: server.add_generic_rpc_handlers((ECHO,))],
                          ["test.Echo"])
    await servers.start()
    await servers.set_serving(True)
    return servers, address


def _refused(metrics: GatewayMetrics, surface: str, reason: str) -> float:
    return metrics.registry.get_sample_value("splitserve_auth_failures_total",
                                             {"surface": surface, "reason": reason}) or 0.0


def test_public_api_keys_missing_wrong_right_and_never_logged(tmp_path: Path) -> None:
    metrics = GatewayMetrics.create()
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")

    async def run() -> None:
        servers, address = await _serve(PUBLIC, SecurityConfig(api_keys_file=str(keys)), metrics)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                say, stream = channel.unary_unary("/test.Echo/Say"), channel.unary_stream("/test.Echo/Stream")
                for metadata, reason in (((), "missing"), ((("authorization", f"Bearer {OTHER_KEY}"),), "invalid"),
                                         ((("x-api-key", KEY + "0"),), "invalid")):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await say(b"hi", metadata=metadata, timeout=5)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        [chunk async for chunk in stream(b"", metadata=metadata, timeout=5)]
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
                good = (("authorization", f"Bearer {KEY}"),)
                assert await say(b"hi", metadata=good, timeout=5) == b"said:hi"
                assert [c async for c in stream(b"", metadata=(("x-api-key", KEY),), timeout=5)] == [b"\0", b"\1", b"\2"]
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        finally:
            await servers.drain(0, 0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
    assert _refused(metrics, "public", "missing") == 2 and _refused(metrics, "public", "invalid") == 4
    refusals = [entry for entry in logs if entry["event"] == "auth.refused"]
    assert len(refusals) == 6
    text = repr(logs)
    assert KEY not in text and OTHER_KEY not in text and "said:" not in text


def test_the_internal_shared_secret_is_sent_by_peer_channels_and_required(tmp_path: Path) -> None:
    metrics = GatewayMetrics.create()

    async def run() -> None:
        servers, address = await _serve(INTERNAL, SecurityConfig(internal_secret=SECRET), metrics)
        with_secret = PeerChannel(address, Security.from_config(SecurityConfig(internal_secret=SECRET)).channels())
        without = PeerChannel(address, ChannelSecurity())
        try:
            echo = with_secret.stub(_EchoStub)
            assert await echo.say(b"x", timeout=5) == b"said:x"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await without.stub(_EchoStub).say(b"x", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await with_secret.close()
            await without.close()
            await servers.drain(0, 0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
    assert _refused(metrics, "internal", "missing") == 1
    assert SECRET not in repr(logs)


class _EchoStub:
    """What a generated stub is: multicallables bound to a channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.say = channel.unary_unary("/test.Echo/Say")
