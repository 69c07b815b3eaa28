"""Worker registry: registration, heartbeats, dropping silent workers, routing choices."""

import asyncio

import pytest

from gateway.registry import Registry
from splitserve_api.v1 import common_pb2, gateway_pb2

DECODE, PREFILL = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL


def _load(total: int = 100, free: int = 100, queued: int = 0) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(kv_blocks_total=total, kv_blocks_free=free, num_queued_prefill_tokens=queued)


def _incarnation(port: int) -> int:
    return 0x5EED0000 + port  # the worker at 127.0.0.1:port, in these tests


async def _register(reg: Registry, role: int, port: int, load: common_pb2.WorkerLoad,
                    incarnation: int | None = None) -> int:
    resp = await reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
        role=role, address=f"127.0.0.1:{port}", model="m", load=load,
        incarnation=incarnation or _incarnation(port)), None)
    assert resp.gateway_incarnation == reg.incarnation
    return resp.worker_id


async def _beat(reg: Registry, worker_id: int, port: int, load: common_pb2.WorkerLoad,
                state: int = common_pb2.WORKER_STATE_SERVING, incarnation: int | None = None
                ) -> gateway_pb2.HeartbeatResponse:
    return await reg.Heartbeat(gateway_pb2.HeartbeatRequest(
        worker_id=worker_id, load=load, state=state, incarnation=incarnation or _incarnation(port)), None)


def test_routing_follows_reported_load_and_what_was_routed() -> None:
    async def run() -> None:
        reg = Registry("m", heartbeat_period_ms=1000, heartbeat_miss_count=3)
        d1 = await _register(reg, DECODE, 1, _load(free=40))
        d2 = await _register(reg, DECODE, 2, _load(free=90))
        p1 = await _register(reg, PREFILL, 3, _load(queued=500))
        p2 = await _register(reg, PREFILL, 4, _load(queued=100))
        assert reg.pick_decode(set()).worker_id == d2  # 10% used beats 60% used
        assert reg.pick_prefill(set()).worker_id == p2
        reg.workers[p2].num_routed_prefill_tokens = 450  # routed here since its last heartbeat
        assert reg.pick_prefill(set()).worker_id == p1
        assert reg.pick_decode({d2}).worker_id == d1
        assert reg.pick_decode({d1, d2}) is None
        await _beat(reg, d1, 1, _load(free=100))
        reg.workers[d2].load = _load(free=99)
        assert reg.pick_decode(set()).worker_id == d1  # now empty
        await _beat(reg, d1, 1, _load(free=100), common_pb2.WORKER_STATE_DRAINING)
        assert reg.pick_decode(set()).worker_id == d2  # draining workers take nothing new
        await reg.stop()

    asyncio.run(run())


def test_a_silent_worker_is_dropped_and_told_to_register_again() -> None:
    async def run() -> None:
        reg = Registry("m", heartbeat_period_ms=50, heartbeat_miss_count=4)  # dropped after 200 ms
        reg.start()
        quiet = await _register(reg, DECODE, 1, _load())
        alive = await _register(reg, DECODE, 2, _load())
        for _ in range(15):  # >= 450 ms, the live one beating every 30 ms
            await asyncio.sleep(0.03)
            await _beat(reg, alive, 2, _load())
        assert set(reg.workers) == {alive}
        reply = await _beat(reg, quiet, 1, _load())
        assert reply.known is False and reply.gateway_incarnation == reg.incarnation
        await reg.stop()

    asyncio.run(run())


@pytest.mark.parametrize("field, request_", [
    ("role", gateway_pb2.RegisterWorkerRequest(address="a:1", model="m")),
    ("address", gateway_pb2.RegisterWorkerRequest(role=DECODE, model="m")),
    ("model", gateway_pb2.RegisterWorkerRequest(role=DECODE, address="a:1", model="other", incarnation=7)),
    ("incarnation", gateway_pb2.RegisterWorkerRequest(role=DECODE, address="a:1", model="m", load=_load())),
    # A worker claiming more free blocks than it has would get negative load and all traffic.
    ("load.kv_blocks_free", gateway_pb2.RegisterWorkerRequest(
        role=DECODE, address="a:1", model="m", incarnation=7, load=_load(total=10, free=11))),
    ("load.kv_blocks_in_transfer", gateway_pb2.RegisterWorkerRequest(
        role=DECODE, address="a:1", model="m", incarnation=7,
        load=common_pb2.WorkerLoad(kv_blocks_total=10, kv_blocks_free=10, kv_blocks_in_transfer=11))),
    ("load.kv_blocks_total", gateway_pb2.RegisterWorkerRequest(
        role=DECODE, address="a:1", model="m", incarnation=7, load=_load(total=0, free=0))),
])
def test_bad_registrations_name_the_field(field: str, request_: gateway_pb2.RegisterWorkerRequest) -> None:
    async def run() -> None:
        reg = Registry("m", heartbeat_period_ms=100, heartbeat_miss_count=3)
        with pytest.raises(ValueError, match=field):
            await reg.RegisterWorker(request_, None)
        assert reg.workers == {}

    asyncio.run(run())


def test_dropping_a_worker_keeps_its_channel_open_while_requests_are_on_it() -> None:
    async def run() -> None:
        reg = Registry("m", heartbeat_period_ms=1000, heartbeat_miss_count=3)
        busy = await _register(reg, DECODE, 1, _load())
        entry = reg.workers[busy]
        entry.num_routed = 1  # a stream is in flight on this worker
        reg.drop(busy, "test")
        assert busy not in reg.workers and reg.pick_decode(set()) is None
        await asyncio.sleep(0)
        assert not entry.channel.closed and entry in reg._retired  # not closed yet
        entry.num_routed = 0
        reg._close_idle_retired()
        assert reg._retired == []
        await asyncio.sleep(0.01)
        assert entry.channel.closed
        await reg.stop()

    asyncio.run(run())
