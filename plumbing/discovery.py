"""Where a worker finds its gateways: one small interface, three sources of the platform.

A worker registers with, and heartbeats to, every gateway its source names
(``plumbing/registration.py`` ``Registrations``); the source is asked again every
``--gateway-refresh-s``. ``--gateway`` picks it by its form::

    host:port[,host:port...]               a static list
    dns:///name:port                       every A and AAAA record of name (the system's resolver and
                                           its search domains: a Service's short name works)
    dns://server[:port]/name:port          the same, asking that DNS server
    kubernetes:///service.namespace:port   the Service's EndpointSlices (in-cluster credentials);
                                           port: a number, or the name of the Service's port

``resolve`` answers the gateways named now. An answer that says there are none (NXDOMAIN, no
records, no endpoints) is an answer: the worker leaves the gateways it had. A source that
could not be asked (timeout, refused, API error) raises ``DiscoveryError``: the worker keeps
the gateways it had and asks again at the next refresh.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit


class DiscoveryError(Exception):
    """The source could not be asked this time (keep what it said before)."""


class GatewaySource(Protocol):
    describe: str

    async def resolve(self) -> list[str]:
        """The gateways' internal ``host:port`` now, sorted; ``DiscoveryError`` when unknown."""
        ...


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str, field: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{field}: {address!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class StaticSource:
    addresses: tuple[str, ...]

    @property
    def describe(self) -> str:
        return ",".join(self.addresses)

    async def resolve(self) -> list[str]:
        return sorted(self.addresses)


@dataclass(frozen=True)
class DnsSource:
    """Every A and AAAA record of ``name``, each with ``port`` (a headless Service's pods)."""

    name: str
    port: int
    server: tuple[str, int] | None = None  # None: the system's resolver (/etc/resolv.conf)
    timeout_s: float = 2.0

    @property
    def describe(self) -> str:
        server = join_host_port(*self.server) if self.server else ""
        return f"dns://{server}/{self.name}:{self.port}"

    def _resolver(self) -> Any:
        import dns.asyncresolver

        if self.server is None:  # a short name gets the search domains (a Service's name in its namespace)
            resolver = dns.asyncresolver.Resolver()
            resolver.use_search_by_default = True
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [self.server[0]]
            resolver.port = self.server[1]
        resolver.lifetime = self.timeout_s
        resolver.cache = None  # a record removed is gone at the next refresh
        return resolver

    async def resolve(self) -> list[str]:
        import dns.exception
        import dns.resolver

        resolver = self._resolver()
        hosts: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await resolver.resolve(self.name, rdtype)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue  # none of this type: an answer
            except dns.exception.DNSException as exc:  # timeout, no server answered
                raise DiscoveryError(f"{self.describe}: {type(exc).__name__}: {exc}") from exc
            hosts.update(record.address for record in answer)
        return sorted(join_host_port(h, self.port) for h in hosts)


@dataclass(frozen=True)
class EndpointSliceSource:
    """The ready-or-starting endpoints of a Service, from its EndpointSlices (``discovery.k8s.io/v1``)
    through the official ``kubernetes`` client; terminating endpoints are left out. Readiness
    is not asked for: a gateway reports NOT_SERVING until workers registered with it."""

    service: str
    namespace: str
    port: str  # a number, or the name of the Service's port
    api: Any = None  # a DiscoveryV1Api; None: built from the in-cluster credentials

    @property
    def describe(self) -> str:
        return f"kubernetes:///{self.service}.{self.namespace}:{self.port}"

    def _list(self) -> list[Any]:
        api = self.api
        if api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            api = client.DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self.service}"
        return list(api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector).items)

    async def resolve(self) -> list[str]:
        try:
            slices = await asyncio.to_thread(self._list)
        except Exception as exc:  # noqa: BLE001 - ApiException, config errors, connection errors
            raise DiscoveryError(f"{self.describe}: {type(exc).__name__}: {exc}") from exc
        return endpoint_addresses(slices, self.port)


def endpoint_addresses(slices: list[Any], port: str) -> list[str]:
    """``host:port`` of every endpoint of ``slices`` (``V1EndpointSlice``) not terminating."""
    found: set[str] = set()
    for piece in slices:
        number = _slice_port(piece, port)
        if number is None:
            continue
        for endpoint in piece.endpoints or []:
            conditions = endpoint.conditions
            if conditions is not None and conditions.terminating:
                continue
            found.update(join_host_port(a, number) for a in endpoint.addresses or [])
    return sorted(found)


def _slice_port(piece: Any, port: str) -> int | None:
    if port.isdigit():
        return int(port)
    return next((p.port for p in piece.ports or [] if p.name == port and p.port), None)


def parse_source(spec: str, field: str = "gateway") -> GatewaySource:
    """The source ``spec`` names; ValueError naming ``field`` when it cannot be one."""
    if spec.startswith("dns:"):
        return _parse_dns(spec, field)
    if spec.startswith("kubernetes:"):
        return _parse_kubernetes(spec, field)
    addresses = tuple(a.strip() for a in spec.split(",") if a.strip())
    if not addresses:
        raise ValueError(f"{field}: no gateway address given")
    for address in addresses:
        split_host_port(address, field)
    return StaticSource(addresses)


def _parse_dns(spec: str, field: str) -> DnsSource:
    parts = urlsplit(spec)
    name, port = split_host_port(parts.path.lstrip("/"), field)
    if not parts.netloc:
        return DnsSource(name, port)
    server = parts.netloc if ":" in parts.netloc.strip("[]") or "]" in parts.netloc else f"{parts.netloc}:53"
    host, server_port = split_host_port(server, field)
    try:
        ipaddress.ip_address(host)  # the server by address, not by a name it would have to resolve
    except ValueError:
        raise ValueError(f"{field}: the DNS server in {spec!r} must be an IP address") from None
    return DnsSource(name, port, (host, server_port))


def _parse_kubernetes(spec: str, field: str) -> EndpointSliceSource:
    target = urlsplit(spec).path.lstrip("/")
    name, _, port = target.rpartition(":")
    service, _, namespace = name.partition(".")
    if not service or not namespace or not port:
        raise ValueError(f"{field}: {spec!r} is not kubernetes:///service.namespace:port")
    return EndpointSliceSource(service, namespace, port)
