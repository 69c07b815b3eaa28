"""Discovery sources (``plumbing/discovery.py``) for each kind:

* DNS through a real DNS server (dnsmasq, ``tests/helpers/dnsmasq.py``): every A record of one
  name, records that change, a name that goes away, a server that stops answering; and a
  worker following the name into real gateway registries bound on 127.0.0.2, .3, .4 (one
  port): a gateway removed from DNS while the worker is registered is left (never picks the
  worker again), one added is registered with.
* Kubernetes EndpointSlices: there is no API server here, so the source is tested on the
  official client's own objects, built from the API's JSON (``V1EndpointSliceList.from_dict``),
  served by a stand-in for ``DiscoveryV1Api`` that records what was asked.
* The static list and the flag's forms.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from kubernetes import client as k8s

from gateway.registry import Registry
from plumbing import rpc
from plumbing.config import RoutingConfig
from plumbing.discovery import (
    DiscoveryError,
    DnsSource,
    EndpointSliceSource,
    StaticSource,
    endpoint_addresses,
    parse_source,
)
from plumbing.kv_event_sender import KVEventSender, KVEventTee
from plumbing.registration import RegistrationClient, Registrations
from splitserve_api.v1 import common_pb2, gateway_pb2_grpc
from tests.helpers.dnsmasq import DOMAIN, DnsServer, shared_port
from tests.helpers.polling import until

NAME = f"gw.{DOMAIN}"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]


def test_dns_every_record_changes_and_removal_through_dnsmasq() -> None:
    with DnsServer({NAME: HOSTS[:3]}) as dns:
        assert dns.resolve(NAME, 50052) == [f"{h}:50052" for h in HOSTS[:3]]
        dns.set(NAME, [HOSTS[0], HOSTS[3]])
        assert dns.resolve(NAME, 7) == [f"{HOSTS[0]}:7", f"{HOSTS[3]}:7"]
        dns.set(NAME, [])  # gone from DNS: an answer (none), not an error
        assert dns.resolve(NAME, 7) == []
        port = dns.port
    with pytest.raises(DiscoveryError, match="dns://127.0.0.1"):  # nobody answers: keep what was known
        asyncio.run(DnsSource(NAME, 7, ("127.0.0.1", port), timeout_s=0.5).resolve())


async def _registry(host: str, port: int) -> tuple[grpc.aio.Server, Registry]:
    reg = Registry("m", heartbeat_period_ms=50, heartbeat_miss_count=20, routing=RoutingConfig())
    server = rpc.make_server()
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(reg, server)
    assert server.add_insecure_port(f"{host}:{port}") == port
    await server.start()
    reg.start()
    return server, reg


def _client(gateway: str, kv_events: KVEventSender | None) -> RegistrationClient:
    return RegistrationClient(gateway, common_pb2.WORKER_ROLE_DECODE, "127.0.0.1:1", "m",
                              common_pb2.KVLayout(block_size=16),
                              lambda: common_pb2.WorkerLoad(kv_blocks_total=16, kv_blocks_free=16),
                              incarnation=99, kv_events=kv_events)


class _Pool:
    def __init__(self) -> None:
        from engine.kv_events import KVEventLog

        self.events = KVEventLog(max_pending=64)


def test_a_worker_follows_a_dns_name_into_every_gateway_it_lists() -> None:
    port = shared_port(HOSTS)
    with DnsServer({NAME: HOSTS[:3]}) as dns:
        async def run() -> None:
            gateways = {h: await _registry(h, port) for h in HOSTS}
            links = Registrations(parse_source(dns.spec(NAME, port)), _client, KVEventTee.install(_Pool()), 0.05)
            links.start()
            picks = lambda h: gateways[h][1].pick_decode(set()) is not None  # noqa: E731
            await until(lambda: all(picks(h) for h in HOSTS[:3]), "every listed gateway picks the worker")
            assert not gateways[HOSTS[3]][1].workers  # not listed: never registered with
            await asyncio.to_thread(dns.set, NAME, [HOSTS[0], HOSTS[2], HOSTS[3]])
            await until(lambda: picks(HOSTS[3]), "the gateway added to DNS picks the worker")
            await until(lambda: not picks(HOSTS[1]), "the gateway removed from DNS stops picking it")
            assert [w.state for w in gateways[HOSTS[1]][1].workers.values()] == [common_pb2.WORKER_STATE_DRAINING]
            assert sorted(links.clients) == [f"{h}:{port}" for h in (HOSTS[0], HOSTS[2], HOSTS[3])]
            await links.stop()
            for server, reg in gateways.values():
                await reg.stop()
                await server.stop(0)

        asyncio.run(run())


def _slices(*items: dict[str, Any]) -> k8s.V1EndpointSliceList:
    return k8s.V1EndpointSliceList.from_dict({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "metadata": {}, "items": list(items)})


def _slice(name: str, endpoints: list[dict[str, Any]], port_name: str = "internal",
           port: int = 50052) -> dict[str, Any]:
    return {"addressType": "IPv4", "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "gw"}},
            "endpoints": endpoints, "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}


class _Api:
    """Stands in for ``kubernetes.client.DiscoveryV1Api`` (no API server here)."""

    def __init__(self, answer: k8s.V1EndpointSliceList) -> None:
        self.answer: k8s.V1EndpointSliceList | Exception = answer
        self.calls: list[tuple[str, str]] = []

    def list_namespaced_endpoint_slice(self, namespace: str, label_selector: str) -> k8s.V1EndpointSliceList:
        self.calls.append((namespace, label_selector))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_endpoint_slices_every_endpoint_not_terminating_on_the_named_port() -> None:
    slices = _slices(
        _slice("gw-1", [{"addresses": ["10.0.0.5"], "conditions": {"ready": False, "terminating": False}},
                        {"addresses": ["10.0.0.6"], "conditions": {"ready": True}},
                        {"addresses": ["10.0.0.7"], "conditions": {"terminating": True}}]),
        _slice("gw-2", [{"addresses": ["10.0.1.1"]}]),
        _slice("gw-3", [{"addresses": ["10.0.2.2"]}], port_name="metrics", port=9400),  # no 'internal' port
    )
    assert endpoint_addresses(slices.items, "internal") == ["10.0.0.5:50052", "10.0.0.6:50052", "10.0.1.1:50052"]
    assert endpoint_addresses(slices.items, "50099") == [
        "10.0.0.5:50099", "10.0.0.6:50099", "10.0.1.1:50099", "10.0.2.2:50099"]
    ipv6 = _slices({**_slice("gw-6", [{"addresses": ["fd00::1"]}]), "addressType": "IPv6"})
    assert endpoint_addresses(ipv6.items, "internal") == ["[fd00::1]:50052"]


def test_endpoint_slice_source_asks_for_the_service_and_follows_changes() -> None:
    api = _Api(_slices(_slice("gw-1", [{"addresses": ["10.0.0.5"]}, {"addresses": ["10.0.0.6"]}])))
    source = parse_source("kubernetes:///gw.splitserve:internal")
    assert isinstance(source, EndpointSliceSource)
    source = EndpointSliceSource(source.service, source.namespace, source.port, api=api)
    assert asyncio.run(source.resolve()) == ["10.0.0.5:50052", "10.0.0.6:50052"]
    assert api.calls == [("splitserve", "kubernetes.io/service-name=gw")]
    api.answer = _slices(_slice("gw-1", [{"addresses": ["10.0.0.6"], "conditions": {"terminating": True}}]))
    assert asyncio.run(source.resolve()) == []  # the last one is going: the worker leaves it
    api.answer = k8s.ApiException(status=403, reason="Forbidden")
    with pytest.raises(DiscoveryError, match="Forbidden"):  # cannot ask: keep what was known
        asyncio.run(source.resolve())


def test_the_flag_forms_and_their_errors() -> None:
    assert parse_source("a:1, b:2") == StaticSource(("a:1", "b:2"))
    assert parse_source("dns:///gw.ns.svc:50052") == DnsSource("gw.ns.svc", 50052)
    assert parse_source("dns://10.0.0.10/gw:1") == DnsSource("gw", 1, ("10.0.0.10", 53))
    assert parse_source("dns://127.0.0.1:5353/gw:1") == DnsSource("gw", 1, ("127.0.0.1", 5353))
    for bad, message in (("", "no gateway address"), ("a:1,b", "'b' is not host:port"),
                         ("dns:///gw", "'gw' is not host:port"), ("dns://ns1/gw:1", "must be an IP address"),
                         ("kubernetes:///gw:1", "service.namespace:port")):
        with pytest.raises(ValueError, match=message) as info:
            parse_source(bad)
        assert str(info.value).startswith("gateway: ")
