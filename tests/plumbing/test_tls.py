"""TLS and mTLS on the servers and channels of ``plumbing/`` (gRPC on 127.0.0.1, real
certificates made in the test): who is refused, and rotation without dropping a stream."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.config import SecurityConfig
from plumbing.security import Security
from plumbing.servers import INTERNAL, PUBLIC, Servers
from plumbing.tls import TlsConfig, TlsStore, load_material
from splitserve.certs import Issued, issue, make_ca

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _files(directory: Path, ca: Issued | list[Issued], leaf: Issued | None) -> TlsConfig:
    """Write a CA bundle (one or more CAs) and a leaf; their TlsConfig."""
    directory.mkdir(parents=True, exist_ok=True)
    cas = ca if isinstance(ca, list) else [ca]
    (directory / "ca.pem").write_bytes(b"".join(c.cert_pem for c in cas))
    if leaf is None:
        return TlsConfig(ca_file=str(directory / "ca.pem"))
    cert, key = leaf.write(directory, "tls")
    return TlsConfig(cert_file=str(cert), key_file=str(key), ca_file=str(directory / "ca.pem"))


async def _check(address: str, config: TlsConfig | None) -> int:
    """One health check on a fresh channel: the status, or raises AioRpcError."""
    security = ChannelSecurity(TlsStore(config) if config is not None else None)
    async with security.dial(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def _serve(config: TlsConfig, surface: str = INTERNAL) -> tuple[Servers, str]:
    servers = Servers(Security.from_config(SecurityConfig(tls=config)), lambda surface, reason: None)
    address = servers.add(surface, "127.0.0.1", 0, [], [])
    await servers.start()
    return servers, address


def test_files_are_checked_when_loaded(tmp_path: Path) -> None:
    ca = make_ca()
    good = _files(tmp_path / "good", ca, issue(ca, "a"))
    assert load_material(good).not_after is not None
    other = issue(ca, "b")
    (tmp_path / "good" / "tls.key").write_bytes(other.key_pem)
    with pytest.raises(ValueError, match="tls_key does not belong to tls_cert"):
        load_material(good)
    with pytest.raises(ValueError, match="tls_cert: cannot read"):
        load_material(TlsConfig(cert_file=str(tmp_path / "missing.pem"), key_file=str(tmp_path / "k")))
    with pytest.raises(ValueError, match="tls_cert and tls_key must be given together"):
        TlsConfig(cert_file="a.pem")
    with pytest.raises(ValueError, match="tls_ca needs tls_cert and tls_key"):
        SecurityConfig(tls=TlsConfig(ca_file=str(tmp_path / "good" / "ca.pem")))


def test_mtls_refuses_clients_without_a_certificate_with_another_ca_or_expired(tmp_path: Path) -> None:
    ca, stranger = make_ca(), make_ca()
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    expired = issue(ca, "expired", not_before=past, not_after=past + dt.timedelta(days=1))

    async def run() -> None:
        servers, address = await _serve(_files(tmp_path / "server", ca, issue(ca, "server")))
        await servers.set_serving(True)
        try:
            assert await _check(address, _files(tmp_path / "ok", ca, issue(ca, "client"))) == SERVING
            refused = {
                "no certificate": _files(tmp_path / "none", ca, None),
                "another CA's certificate": _files(tmp_path / "other", [ca, stranger], issue(stranger, "x")),
                "an expired certificate": _files(tmp_path / "expired", ca, expired),
                "trusts another CA": _files(tmp_path / "distrust", stranger, issue(stranger, "y")),
                "plaintext": None,
            }
            for what, config in refused.items():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _check(address, config)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what
        finally:
            await servers.drain(0, 0)

    asyncio.run(run())


def test_the_public_surface_asks_no_client_certificate(tmp_path: Path) -> None:
    ca = make_ca()

    async def run() -> None:
        servers, address = await _serve(_files(tmp_path / "server", ca, issue(ca, "server")), PUBLIC)
        try:
            assert await _check(address, _files(tmp_path / "client", ca, None)) == SERVING
            with pytest.raises(grpc.aio.AioRpcError):
                await _check(address, None)  # plaintext to a TLS port
        finally:
            await servers.drain(0, 0)

    asyncio.run(run())


def test_sighup_rotates_the_server_certificate_and_an_open_stream_survives(tmp_path: Path) -> None:
    old_ca, new_ca = make_ca(), make_ca()
    config = _files(tmp_path / "server", old_ca, issue(old_ca, "server"))
    old_client = _files(tmp_path / "old-client", old_ca, issue(old_ca, "client"))
    new_client = _files(tmp_path / "new-client", new_ca, issue(new_ca, "client"))

    async def run() -> None:
        servers, address = await _serve(config)
        security = servers.security
        reloads = asyncio.ensure_future(security.watch())
        await servers.set_serving(True)
        watcher = PeerChannel(address, ChannelSecurity(TlsStore(old_client)))
        watch = watcher.stub(health_pb2_grpc.HealthStub).Watch(health_pb2.HealthCheckRequest())
        try:
            assert (await watch.read()).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError):
                await _check(address, new_client)
            # Rotate: a bundle trusting both CAs, a certificate of the new one; then SIGHUP.
            _files(tmp_path / "server", [old_ca, new_ca], issue(new_ca, "server"))
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(200):
                if security.tls.generation == 1:
                    break
                await asyncio.sleep(0.01)
            assert security.tls.generation == 1
            assert await _check(address, new_client) == SERVING  # the new certificate is presented
            with pytest.raises(grpc.aio.AioRpcError):
                await _check(address, old_client)  # ... so a client trusting only the old CA is refused
            await servers.set_serving(False)
            assert (await watch.read()).status == NOT_SERVING  # the stream opened before is alive
            await servers.health.end_watches()
            assert await watch.read() is grpc.aio.EOF
            assert await watch.code() == grpc.StatusCode.OK
        finally:
            reloads.cancel()
            await watcher.close()
            await servers.drain(0, 0)

    asyncio.run(run())


def test_a_peer_channel_rotates_for_new_calls_and_closes_the_old_one_after_its_stream(tmp_path: Path) -> None:
    ca = make_ca()
    client = _files(tmp_path / "client", ca, issue(ca, "client-1"))

    async def run() -> None:
        servers, address = await _serve(_files(tmp_path / "server", ca, issue(ca, "server")))
        await servers.set_serving(True)
        store = TlsStore(client)
        peer = PeerChannel(address, ChannelSecurity(store))
        watch = peer.stub(health_pb2_grpc.HealthStub).Watch(health_pb2.HealthCheckRequest())
        try:
            assert (await watch.read()).status == SERVING
            _files(tmp_path / "client", ca, issue(ca, "client-2"))
            assert store.reload() and store.generation == 1  # the files changed: no SIGHUP needed
            assert store.reload() is False  # nothing changed since
            reply = await peer.stub(health_pb2_grpc.HealthStub).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == SERVING and len(peer._retired) == 1 and peer.in_flight == 1
            await servers.set_serving(False)
            assert (await watch.read()).status == NOT_SERVING  # the old channel still carries it
            await servers.health.end_watches()
            assert await watch.read() is grpc.aio.EOF
            await asyncio.sleep(0.05)
            assert peer._retired == [] and peer.in_flight == 0  # closed once its stream ended
        finally:
            await peer.close()
            await servers.drain(0, 0)

    asyncio.run(run())


def test_a_broken_rotation_keeps_the_previous_certificate(tmp_path: Path) -> None:
    ca = make_ca()
    config = _files(tmp_path / "tls", ca, issue(ca, "a"))
    store = TlsStore(config)
    before = store.material
    (tmp_path / "tls" / "tls.key").write_bytes(issue(ca, "b").key_pem)  # half a rotation: key only
    assert store.reload() is False and store.material == before and store.generation == 0
    issue(ca, "b").write(tmp_path / "tls", "tls")  # the whole pair
    assert store.reload() is True and store.generation == 1 and store.material != before
