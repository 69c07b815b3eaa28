"""Gateway replicas, worker side (``plumbing/registration.py`` ``Registrations``): a worker
registers with every gateway its discovery source names, over gRPC on 127.0.0.1:0, with
one KV-event log per gateway (``KVEventTee``): each replica's prefix index converges from
the worker's own events, a replica that joins later gets the whole cache, and a replica the
source stops naming is left (DRAINING there: never picked again) while the others keep it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.kv_events import KVEventLog
from gateway.registry import Registry
from plumbing import rpc
from plumbing.config import RoutingConfig
from plumbing.discovery import DiscoveryError, StaticSource
from plumbing.kv_event_sender import KVEventSender, KVEventTee
from plumbing.registration import RegistrationClient, Registrations
from splitserve_api.v1 import common_pb2, gateway_pb2_grpc
from tests.helpers.polling import until

H = [bytes([i + 1]) * 16 for i in range(8)]
DECODE = common_pb2.WORKER_ROLE_DECODE


class ListSource:
    """A discovery source whose answer the test sets (the real sources: test_discovery.py)."""

    describe = "test list"

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.fail = False

    async def resolve(self) -> list[str]:
        if self.fail:
            raise DiscoveryError("cannot ask")
        return sorted(self.addresses)


class Pool:
    """What ``KVEventTee.install`` replaces: a block pool's ``events``."""

    def __init__(self) -> None:
        self.events = KVEventLog(max_pending=64)


async def _registry() -> tuple[grpc.aio.Server, Registry, str]:
    reg = Registry("m", heartbeat_period_ms=50, heartbeat_miss_count=20,
                   routing=RoutingConfig(kv_events_interval_ms=10))
    server = rpc.make_server()
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(reg, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reg.start()
    return server, reg, f"127.0.0.1:{port}"


def _load() -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(kv_blocks_total=16, kv_blocks_free=16)


def _client(gateway: str, kv_events: KVEventSender | None) -> RegistrationClient:
    return RegistrationClient(gateway, DECODE, "127.0.0.1:1", "m", common_pb2.KVLayout(block_size=16), _load,
                              incarnation=4242, kv_events=kv_events)


def _cached(reg: Registry) -> set[bytes]:
    return {h for entry in reg.workers.values() for h in H if h in entry.prefix}


def test_a_worker_registers_with_every_replica_and_each_index_converges() -> None:
    async def run() -> None:
        gateways = [await _registry() for _ in range(3)]
        pool = Pool()
        tee = KVEventTee.install(pool)
        assert pool.events is tee
        source = ListSource([g[2] for g in gateways[:2]])
        links = Registrations(source, _client, tee, refresh_s=0.05)
        started = time.monotonic()
        links.start()
        await until(lambda: all(len(g[1].workers) == 1 for g in gateways[:2]), "both replicas see the worker")
        assert time.monotonic() - started < 2.0  # each replica sees the worker within 2 s (here: far less)
        (a,), (b,) = (list(g[1].workers.values()) for g in gateways[:2])
        assert a.incarnation == b.incarnation == 4242  # one process: the same incarnation to both
        for h in H[:4]:
            tee.stored(h)
        tee.removed(H[0])
        await until(lambda: all(_cached(g[1]) == set(H[1:4]) for g in gateways[:2]), "both indexes converge")
        # A replica that joins later gets the whole cache (its own log, a branch of the engine's).
        source.addresses.append(gateways[2][2])
        await until(lambda: _cached(gateways[2][1]) == set(H[1:4]), "the new replica has the whole cache")
        assert tee.num_branches == 3
        tee.stored(H[5])
        await until(lambda: all(_cached(g[1]) == {*H[1:4], H[5]} for g in gateways), "every replica sees the change")
        await links.stop()
        for server, reg, _ in gateways:
            await reg.stop()
            await server.stop(0)

    asyncio.run(run())


def test_a_replica_the_source_stops_naming_is_left_and_never_picks_the_worker_again() -> None:
    async def run() -> None:
        gateways = [await _registry() for _ in range(2)]
        tee = KVEventTee.install(Pool())
        source = ListSource([g[2] for g in gateways])
        links = Registrations(source, _client, tee, refresh_s=0.05)
        links.start()
        await until(lambda: all(g[1].pick_decode(set()) is not None for g in gateways), "both pick the worker")
        source.fail = True  # a source that cannot be asked changes nothing
        await asyncio.sleep(0.3)
        assert sorted(links.clients) == sorted(g[2] for g in gateways)
        source.fail = False
        source.addresses = [gateways[0][2]]
        left = gateways[1][1]
        await until(lambda: left.pick_decode(set()) is None, "the left replica stops picking the worker")
        (entry,) = left.workers.values()
        assert entry.state == common_pb2.WORKER_STATE_DRAINING  # told, not waited out
        assert gateways[0][1].pick_decode(set()) is not None and tee.num_branches == 1
        await until(lambda: not left.workers, "the left replica drops the worker after its missed beats")
        links.state = common_pb2.WORKER_STATE_DRAINING
        await links.beat_once()  # the drain reaches every replica it still has
        assert [w.state for w in gateways[0][1].workers.values()] == [common_pb2.WORKER_STATE_DRAINING]
        await links.stop()
        for server, reg, _ in gateways:
            await reg.stop()
            await server.stop(0)

    asyncio.run(run())


def test_static_source_answers_its_list() -> None:
    assert asyncio.run(StaticSource(("b:2", "a:1")).resolve()) == ["a:1", "b:2"]


def test_the_tee_copies_each_change_into_every_branch_until_pruned() -> None:
    pool = Pool()
    tee = KVEventTee.install(pool)
    first = tee.branch()
    tee.stored(H[0])
    tee.stored(H[1])
    second = tee.branch()  # joins late: the whole cache as it is now
    tee.removed(H[0])
    tee.prune(first)
    tee.stored(H[2])
    assert first.cached_hashes() == {H[1]}  # nothing after its prune
    assert second.cached_hashes() == {H[1], H[2]} == tee.cached_hashes()
    batch = second.take(16)
    assert batch is not None and batch.reset and dict(batch.items) == {H[0]: False, H[1]: True, H[2]: True}
    assert tee.num_branches == 1
    busy = Pool()
    busy.events.stored(H[3])
    with pytest.raises(RuntimeError, match="already cached"):  # its cache would be missing from every branch
        KVEventTee.install(busy)
