"""The listening side of one service process: a gRPC server per surface, and the drain.

Each surface is its own ``grpc.aio`` server (interceptors and credentials are per server):

* ``public`` (the gateway's ``--port``): the public API; TLS when the process has a
  certificate (no client certificate asked), API keys when configured.
* ``internal`` (the gateway's ``--internal-port``, a worker's ``--port``): registration and
  the worker RPCs; TLS, client certificates required when a CA is given (mTLS), the shared
  secret when configured.
* ``health`` (``--health-port``): grpc.health.v1 only, plaintext, for kubelet probes (they
  cannot speak TLS).

One health servicer answers on every port: the whole server ("") and each service SERVING
or NOT_SERVING (readiness), and ``liveness`` SERVING as long as the process answers. The
drain (``drain``), in order:

1. every port reports NOT_SERVING, and keeps accepting connections and calls for
   ``drain_grace_s`` (a kubelet probe, a fresh connection each time, sees NOT_SERVING instead
   of "connection refused"; load balancers still catching up are served);
2. health ``Watch`` streams end;
3. the public and internal servers stop: new calls refused, in-flight ones get
   ``drain_timeout_s`` to finish, then are cancelled;
4. the health port closes last, giving the checks it has accepted up to
   ``HEALTH_CLOSE_GRACE_S`` to be answered. A check accepted but not yet started when a
   server stops without a grace is cancelled before its handler runs, and grpc then prints
   a raw traceback to stderr (``_schedule_rpc_coro``'s ``traceback.print_exc``), outside
   the JSON log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from plumbing import rpc, tracing
from plumbing.auth import AuthInterceptor
from plumbing.health import SERVING, DrainingHealthServicer
from plumbing.reflection import add_reflection
from plumbing.security import Security

log = structlog.get_logger()
PUBLIC, INTERNAL, HEALTH = "public", "internal", "health"
# The health service name liveness probes check: SERVING while the event loop answers, also
# while starting (no decode worker yet) and draining, when the server ("") is NOT_SERVING.
LIVENESS = "liveness"
# How long the health port's last checks get to be answered when it closes. A check takes
# microseconds; the bound only matters if the event loop is stalled.
HEALTH_CLOSE_GRACE_S = 1.0
Register = Callable[[grpc.aio.Server], None]


@dataclass
class Surface:
    name: str
    server: grpc.aio.Server
    address: str  # host:port as bound


class Servers:
    """The ports of one service process (event-loop owned)."""

    def __init__(self, security: Security, on_auth_refused: Callable[[str, str], None]) -> None:
        self.security = security
        self.health = DrainingHealthServicer()
        self.surfaces: dict[str, Surface] = {}
        self.service_names: list[str] = []
        self._on_auth_refused = on_auth_refused

    def _interceptors(self, surface: str) -> list[grpc.aio.ServerInterceptor]:
        tokens = {PUBLIC: self.security.api_keys, INTERNAL: self.security.internal_secret}.get(surface)
        auth = [AuthInterceptor(tokens, surface, self._on_auth_refused)] if tokens is not None else []
        return [*tracing.server_interceptors(), *auth, rpc.ErrorMappingInterceptor()]

    def _credentials(self, surface: str) -> grpc.ServerCredentials | None:
        if surface == HEALTH or not self.security.serves_tls:
            return None
        assert self.security.tls is not None
        return self.security.tls.server_credentials(client_auth=surface == INTERNAL and self.security.mutual_tls)

    def add(self, surface: str, host: str, port: int, register: list[Register], names: list[str]) -> str:
        """Serve the services ``register`` adds (named ``names``) on ``host:port`` as
        ``surface``; returns the bound ``host:port``."""
        server = rpc.make_server(interceptors=self._interceptors(surface))
        for add in register:
            add(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if surface != HEALTH:
            add_reflection(server, [*names, "grpc.health.v1.Health"])
        credentials = self._credentials(surface)
        address = f"{host}:{port}"
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
        if bound == 0:
            raise OSError(f"could not bind {address} ({surface})")
        if surface == INTERNAL:
            self.security.warn_if_open(host)
        self.service_names += [n for n in names if n not in self.service_names]
        self.surfaces[surface] = Surface(surface, server, f"{host}:{bound}")
        return self.surfaces[surface].address

    def add_health(self, host: str, port: int) -> str | None:
        """The plaintext health-only port, unless ``port`` is -1."""
        return None if port < 0 else self.add(HEALTH, host, port, [], [])

    async def start(self) -> None:
        await self.health.set(LIVENESS, SERVING)  # the process answers; drain does not change it
        for surface in self.surfaces.values():
            await surface.server.start()

    async def set_serving(self, serving: bool) -> None:
        await self.health.set_all(self.service_names, serving)

    async def drain(self, grace_s: float, timeout_s: float) -> None:
        """NOT_SERVING for ``grace_s`` while serving, end Watch streams, stop (in-flight calls
        get ``timeout_s``), close the health port last."""
        await self.set_serving(False)
        if grace_s > 0:
            log.info("drain.grace", seconds=grace_s)
            await asyncio.sleep(grace_s)
        await self.health.end_watches()
        working = [s for s in self.surfaces.values() if s.name != HEALTH]
        await asyncio.gather(*(s.server.stop(timeout_s) for s in working))
        if HEALTH in self.surfaces:
            await self.surfaces[HEALTH].server.stop(HEALTH_CLOSE_GRACE_S)


def write_ready_file(path: str, surfaces: dict[str, str | None]) -> None:
    """One ``surface host:port`` line for each surface that listens (``public``, ``internal``,
    ``health``, ``metrics``; None: not served), written whole (renamed into place): a reader
    never sees half of it. ``read_ready_file`` reads it back."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text("\n".join(f"{name} {address}" for name, address in surfaces.items() if address))
    tmp.replace(path)


def read_ready_file(text: str) -> dict[str, str]:
    """A ready file's text as {surface: host:port}."""
    return dict(line.split(" ", 1) for line in text.splitlines() if line)
