"""A worker's KV events ride its heartbeats over gRPC (127.0.0.1:0) into the gateway's
prefix index: delivered once acknowledged, re-sent whole after a re-registration, never
sent to a gateway that routes by load."""

from __future__ import annotations

import asyncio

import grpc

from engine.kv_events import KVEventLog
from gateway.registry import Registry
from plumbing import rpc
from plumbing.config import RoutingConfig
from plumbing.kv_event_sender import KVEventSender
from plumbing.registration import RegistrationClient
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

H = [bytes([i + 1]) * 16 for i in range(6)]


def _load() -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(kv_blocks_total=16, kv_blocks_free=16)


async def _serve(routing: RoutingConfig) -> tuple[grpc.aio.Server, Registry, RegistrationClient, KVEventLog]:
    reg = Registry("m", heartbeat_period_ms=100, heartbeat_miss_count=3, routing=routing)
    server = rpc.make_server()
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(reg, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    log = KVEventLog(max_pending=64)
    client = RegistrationClient(f"127.0.0.1:{port}", common_pb2.WORKER_ROLE_PREFILL, "127.0.0.1:1", "m",
                                common_pb2.KVLayout(block_size=16), _load, incarnation=77,
                                kv_events=KVEventSender(log))
    return server, reg, client, log


def _index(reg: Registry) -> set[bytes]:
    (entry,) = reg.workers.values()
    return {h for h in H if h in entry.prefix}


def test_events_reach_the_index_and_a_new_registration_resends_the_whole_cache() -> None:
    async def run() -> None:
        server, reg, client, log = await _serve(RoutingConfig(kv_events_max_per_beat=2))
        await client.register()
        for h in H[:3]:
            log.stored(h)
        await client.beat_once()  # two per beat
        assert _index(reg) == set(H[:2]) and log.has_pending()
        await asyncio.wait_for(client.kv_events.wait(60.0), 5.0)  # due early: the cache changed
        await client.beat_once()
        assert _index(reg) == set(H[:3]) and not log.has_pending()
        log.removed(H[0])
        log.stored(H[3])
        await client.beat_once()
        assert _index(reg) == {H[1], H[2], H[3]}
        reg.drop(client.worker_id, "test")  # forgotten: the next beat registers again
        await client.beat_once()
        assert len(reg.workers) == 1 and _index(reg) == set()
        for _ in range(2):
            await client.beat_once()
        assert _index(reg) == {H[1], H[2], H[3]} and not log.has_pending()
        await client.stop()
        await server.stop(None)
        await reg.stop()

    asyncio.run(run())


def test_a_gateway_routing_by_load_is_sent_no_events() -> None:
    async def run() -> None:
        server, reg, client, log = await _serve(RoutingConfig(policy="load"))
        await client.register()
        log.stored(H[0])
        await client.beat_once()
        (entry,) = reg.workers.values()
        assert len(entry.prefix) == 0 and client.kv_events.max_per_beat == 0 and log.has_pending()
        await client.stop()
        await server.stop(None)
        await reg.stop()

    asyncio.run(run())


def test_a_refused_batch_is_resent_from_a_clean_slate() -> None:
    log = KVEventLog(max_pending=64)
    sender = KVEventSender(log)
    sender.configure(gateway_pb2.RegisterWorkerResponse(kv_events_max_per_beat=8, kv_events_interval_ms=10))
    log.ack(log.take(8))
    log.stored(H[0])
    batch = sender.attach(gateway_pb2.HeartbeatRequest())
    assert not batch.reset
    refused = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata())
    sender.failed(refused, batch)
    again = sender.attach(gateway_pb2.HeartbeatRequest())
    assert again.reset and again.stored == [H[0]]
    lost = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
    sender.failed(lost, again)  # merely lost: the same changes go again, still from scratch
    assert sender.attach(gateway_pb2.HeartbeatRequest()).items == again.items
