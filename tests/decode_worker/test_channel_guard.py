"""OpenKVChannel cannot be turned against the decode worker (issue #10, item 7): it dials
only the caller's own address, waits at most its own timeout, and a flood of handshakes is
refused at once instead of queueing behind each other or holding up the process's exit."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

import decode_worker.kv_inbox as kv_inbox_module
from decode_worker.kv_channels import dial_is_callers, join
from decode_worker.kv_inbox import KVInbox
from engine.kv_layout import KVLayout
from plumbing.blocking import DaemonCalls
from plumbing.convert import kv_layout_to_proto
from plumbing.rpc import ServiceError
from plumbing.transport.nccl_lib import NcclLibrary, bootstrap_host
from splitserve_api.v1 import kv_transfer_pb2

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def test_only_the_callers_own_address_may_be_dialed() -> None:
    assert dial_is_callers("127.0.0.1", "127.0.0.1")
    assert dial_is_callers("localhost", "127.0.0.1")
    assert dial_is_callers("198.51.100.7", "198.51.100.7")
    assert not dial_is_callers("198.51.100.8", "198.51.100.7")  # somebody else's address
    assert not dial_is_callers("198.51.100.8", "127.0.0.1")  # not this machine's either
    assert not dial_is_callers("127.0.0.1", "198.51.100.7")  # a remote caller naming our loopback
    assert not dial_is_callers("127.0.0.1", None)  # a caller that is not on IP


def test_the_nccl_bootstrap_address_is_read_from_the_unique_id() -> None:
    unique_id = NcclLibrary().get_unique_id()
    host = bootstrap_host(unique_id)
    assert host is not None and dial_is_callers(host, "127.0.0.1")  # rank 0 is this machine
    forged = bytearray(unique_id)
    forged[12:16] = bytes([198, 51, 100, 8])
    request = kv_transfer_pb2.KVChannelHandshake(transport=kv_transfer_pb2.TRANSPORT_KIND_NCCL,
                                                 nccl_unique_id=bytes(forged))
    with pytest.raises(ServiceError) as info:
        join(request, "127.0.0.1", "cpu", 1.0)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "nccl_unique_id" in info.value.message


def _inbox(max_timeout_s: float = 2.0) -> KVInbox:
    engine = SimpleNamespace(kv_layout=LAYOUT)
    return KVInbox(engine, None, "cpu", None, lambda fn: None, incarnation=5,  # type: ignore[arg-type]
                   max_timeout_s=max_timeout_s)


def _handshake(host: str, timeout_ms: int, prefill_incarnation: int = 3) -> kv_transfer_pb2.KVChannelHandshake:
    return kv_transfer_pb2.KVChannelHandshake(
        transport=kv_transfer_pb2.TRANSPORT_KIND_GLOO, kv_layout=kv_layout_to_proto(LAYOUT),
        gloo=kv_transfer_pb2.GlooRendezvous(host=host, port=9), timeout_ms=timeout_ms,
        prefill_incarnation=prefill_incarnation)


def test_a_handshake_naming_another_host_is_refused_and_the_timeout_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        inbox = _inbox()
        with pytest.raises(ServiceError) as info:
            await inbox.open_channel(_handshake("198.51.100.8", 1000), caller="127.0.0.1")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "gloo.host" in info.value.message
        seen: list[float] = []

        def fake_join(request: object, caller: object, device: object, timeout_s: float) -> object:
            seen.append(timeout_s)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no peer in this test")

        monkeypatch.setattr(kv_inbox_module.kv_channels, "join", fake_join)
        with pytest.raises(ServiceError):
            await inbox.open_channel(_handshake("127.0.0.1", 2**32 - 1), caller="127.0.0.1")
        assert seen == [2.0]  # the caller asked for 49 days
        with pytest.raises(ValueError, match="prefill_incarnation"):
            handshake = _handshake("127.0.0.1", 10)
            handshake.prefill_incarnation = 0
            await inbox.open_channel(handshake, caller="127.0.0.1")

    asyncio.run(run())


def test_blocking_calls_are_bounded_refused_beyond_and_late_results_discarded() -> None:
    async def run() -> None:
        gate = threading.Event()
        discarded: list[str] = []
        calls: DaemonCalls[str] = DaemonCalls("test", max_running=2, max_queued=1, discard=discarded.append)
        running = [asyncio.ensure_future(calls.run(lambda i=i: (gate.wait(30), f"r{i}")[1])) for i in range(2)]
        queued = asyncio.ensure_future(calls.run(lambda: "q"))
        await asyncio.sleep(0.05)
        assert calls.num_running == 2 and calls.num_queued == 1
        with pytest.raises(ServiceError) as info:  # two running and one waiting: the fourth is refused
            await calls.run(lambda: "x")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        running[0].cancel()  # its caller gives up; the thread still holds its slot
        await asyncio.sleep(0.05)
        assert calls.num_running == 2 and not queued.done()
        gate.set()
        assert await running[1] == "r1" and await queued == "q"
        for _ in range(500):  # the abandoned call's thread reports back on its own time
            if calls.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert calls.num_running == 0 and discarded == ["r0"]  # the abandoned result was handed to discard
        assert all(t.daemon for t in threading.enumerate() if t.name == "test-call")

    asyncio.run(run())
