"""Worker identity at the registry (issue #10, items 3 and 7): ids are minted, heartbeats are
bound to the worker's incarnation, the gateway's incarnation makes workers re-register after
a gateway restart, and what workers report is checked."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import gateway.registry as registry_module
from gateway.registry import Registry
from plumbing import rpc
from plumbing.registration import RegistrationClient
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

DECODE = common_pb2.WORKER_ROLE_DECODE


def _load(total: int = 100, free: int = 100) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(kv_blocks_total=total, kv_blocks_free=free)


def _registration(port: int, incarnation: int, load: common_pb2.WorkerLoad | None = None
                  ) -> gateway_pb2.RegisterWorkerRequest:
    return gateway_pb2.RegisterWorkerRequest(role=DECODE, address=f"127.0.0.1:{port}", model="m",
                                             load=load or _load(), incarnation=incarnation)


def _beat(worker_id: int, incarnation: int, state: int = common_pb2.WORKER_STATE_SERVING,
          load: common_pb2.WorkerLoad | None = None) -> gateway_pb2.HeartbeatRequest:
    return gateway_pb2.HeartbeatRequest(worker_id=worker_id, incarnation=incarnation, state=state,
                                        load=load or _load())


def test_an_old_worker_id_reused_after_a_gateway_restart_is_not_taken_for_its_new_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's item 3: ids restarted at 1 and a heartbeat was trusted by id alone, so a
    worker whose old id now belonged to another one was told it was known and never
    re-registered. Here the new gateway is even made to mint the colliding id."""
    async def run() -> None:
        old_gateway = Registry("m", 500, 3)
        a_id = (await old_gateway.RegisterWorker(_registration(1, incarnation=111), None)).worker_id
        new_gateway = Registry("m", 500, 3)
        monkeypatch.setattr(registry_module, "mint_id", lambda: a_id)
        b_id = (await new_gateway.RegisterWorker(_registration(2, incarnation=222), None)).worker_id
        assert b_id == a_id  # the collision of the issue
        reply = await new_gateway.Heartbeat(_beat(a_id, incarnation=111), None)
        assert reply.known is False  # worker A must register again
        assert reply.gateway_incarnation == new_gateway.incarnation != old_gateway.incarnation
        await old_gateway.stop()
        await new_gateway.stop()

    asyncio.run(run())


def test_a_forged_draining_heartbeat_does_not_take_a_worker_out_of_routing() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3)
        worker_id = (await reg.RegisterWorker(_registration(1, incarnation=0xABCDEF), None)).worker_id
        forged = await reg.Heartbeat(_beat(worker_id, 0xABCDEE, common_pb2.WORKER_STATE_DRAINING), None)
        assert forged.known is False
        assert reg.pick_decode(set()).worker_id == worker_id  # still routed to
        real = await reg.Heartbeat(_beat(worker_id, 0xABCDEF, common_pb2.WORKER_STATE_DRAINING), None)
        assert real.known is True and reg.pick_decode(set()) is None
        await reg.stop()

    asyncio.run(run())


def test_worker_ids_are_minted_and_a_restarted_worker_replaces_its_entry() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3)
        first = (await reg.RegisterWorker(_registration(1, incarnation=1), None)).worker_id
        second = (await reg.RegisterWorker(_registration(2, incarnation=2), None)).worker_id
        assert first != second and max(first, second) > 1 << 32  # not a counter from 1
        restarted = (await reg.RegisterWorker(_registration(1, incarnation=3), None)).worker_id
        assert set(reg.workers) == {second, restarted}  # one entry per address
        assert (await reg.Heartbeat(_beat(first, 1), None)).known is False
        await reg.stop()

    asyncio.run(run())


@pytest.mark.parametrize("load, field", [
    (_load(total=10, free=11), "load.kv_blocks_free"),
    (_load(total=12, free=10), "load.kv_blocks_total changed"),
    (common_pb2.WorkerLoad(kv_blocks_total=10, kv_blocks_free=10, num_queued_prefill_tokens=1 << 50),
     "load.num_queued_prefill_tokens"),
])
def test_impossible_heartbeat_loads_are_refused_and_do_not_refresh_the_worker(
    load: common_pb2.WorkerLoad, field: str,
) -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3)
        worker_id = (await reg.RegisterWorker(_registration(1, 5, _load(total=10, free=4)), None)).worker_id
        entry = reg.workers[worker_id]
        beat_before = entry.last_beat
        with pytest.raises(ValueError, match=field):
            await reg.Heartbeat(_beat(worker_id, 5, load=load), None)
        assert entry.last_beat == beat_before and entry.load.kv_blocks_free == 4
        with pytest.raises(ValueError, match="state"):
            await reg.Heartbeat(_beat(worker_id, 5, state=9, load=_load(total=10, free=4)), None)
        await reg.stop()

    asyncio.run(run())


def test_requests_wait_for_the_first_decode_worker_within_the_startup_grace() -> None:
    async def run() -> None:
        reg = Registry("m", 500, 3, startup_grace_s=30.0)
        assert reg.startup_left_s() > 0
        waiting = asyncio.ensure_future(reg.wait_for_decode(30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await reg.RegisterWorker(_registration(1, incarnation=9), None)
        await asyncio.wait_for(waiting, 5)  # woken by the registration, not by the grace
        assert reg.startup_left_s() == 0.0
        await reg.stop()

    asyncio.run(run())


async def _serve_registry(port: int) -> tuple[grpc.aio.Server, Registry, int]:
    reg = Registry("m", heartbeat_period_ms=100, heartbeat_miss_count=3)
    server = rpc.make_server()
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(reg, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, reg, bound


def test_a_worker_registers_again_with_a_restarted_gateway_on_the_same_address() -> None:
    async def run() -> None:
        server, old, port = await _serve_registry(0)
        client = RegistrationClient(f"127.0.0.1:{port}", DECODE, "127.0.0.1:1", "m",
                                    common_pb2.KVLayout(), _load, incarnation=77)
        await client.register()
        assert client.gateway_incarnation == old.incarnation
        await server.stop(None)
        server, new, _ = await _serve_registry(port)
        for _ in range(50):  # the channel reconnects within its backoff (at most 1 s)
            try:
                await client.beat_once()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        assert [w.incarnation for w in new.workers.values()] == [77]
        assert client.gateway_incarnation == new.incarnation
        await client.stop()
        await server.stop(None)
        await old.stop()
        await new.stop()

    asyncio.run(run())
