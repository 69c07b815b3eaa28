"""Worker side of the registry: register with each gateway, then heartbeat until stopped.

Gateways are replicas (docs/architecture.md, "Gateway replicas"): a worker registers with
every gateway its discovery source names (``Registrations``, one ``RegistrationClient`` each),
so each replica learns every worker from the worker itself.

Registration and every heartbeat carry this process's incarnation (``plumbing.identity``):
the gateway counts a heartbeat only for the (worker id, incarnation) pair it registered. A
heartbeat the gateway answers with ``known=False`` (it restarted, dropped us after missed
beats, or another process registered at our address), or with a gateway incarnation other
than the one we registered with (the gateway restarted), triggers a fresh registration.
Failures are logged and retried each period; the worker keeps serving whatever it holds
meanwhile. Heartbeats also carry the prefix cache's KV events when the gateway asks for them
(``plumbing/kv_event_sender.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.discovery import DiscoveryError, GatewaySource
from plumbing.kv_event_sender import KVEventSender, KVEventTee
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = structlog.get_logger()


class RegistrationClient:
    def __init__(
        self,
        gateway_address: str,
        role: int,
        address: str,
        model: str,
        kv_layout: common_pb2.KVLayout,
        load: Callable[[], common_pb2.WorkerLoad],
        incarnation: int,
        security: ChannelSecurity | None = None,
        kv_events: KVEventSender | None = None,
        quantization: str = "none",
        batch_invariant: bool = False,
    ) -> None:
        # The gateway's internal port: mTLS and/or the shared secret (plumbing/channels.py).
        self.gateway = gateway_address
        self._channel = PeerChannel(gateway_address, security or ChannelSecurity())
        self._role = role
        self._address = address
        self._model = model
        self._layout = kv_layout
        self._quantization = quantization
        self._batch_invariant = batch_invariant
        self._load = load
        self.incarnation = incarnation
        self.gateway_incarnation = 0  # from the last registration
        self.worker_id: int | None = None
        self.period_s = 0.5
        self.state = common_pb2.WORKER_STATE_SERVING
        self._task: asyncio.Task[None] | None = None
        self.kv_events = kv_events

    async def register(self) -> int:
        resp = await self._stub().RegisterWorker(
            gateway_pb2.RegisterWorkerRequest(
                role=self._role, address=self._address, model=self._model,
                kv_layout=self._layout, load=self._load(), incarnation=self.incarnation,
                quantization=self._quantization, batch_invariant=self._batch_invariant,
            ),
            timeout=5.0,
        )
        self.worker_id = resp.worker_id
        self.gateway_incarnation = resp.gateway_incarnation
        self.period_s = max(resp.heartbeat_period_ms, 10) / 1000.0
        if self.kv_events is not None:
            self.kv_events.configure(resp)
        log.info("registry.registered", gateway=self.gateway, worker_id=self.worker_id, period_s=self.period_s)
        return self.worker_id

    def _stub(self) -> gateway_pb2_grpc.WorkerRegistryStub:
        return self._channel.stub(gateway_pb2_grpc.WorkerRegistryStub)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat_forever())

    async def beat_once(self) -> None:
        if self.worker_id is None:
            await self.register()
            return
        request = gateway_pb2.HeartbeatRequest(worker_id=self.worker_id, load=self._load(), state=self.state,
                                               incarnation=self.incarnation)
        batch = self.kv_events.attach(request) if self.kv_events is not None else None
        try:
            resp = await self._stub().Heartbeat(request, timeout=max(self.period_s, 1.0))
        except grpc.aio.AioRpcError as exc:
            if self.kv_events is not None:
                self.kv_events.failed(exc, batch)
            raise
        if resp.known and resp.gateway_incarnation == self.gateway_incarnation and self.kv_events is not None:
            self.kv_events.delivered(batch)
        if not resp.known or resp.gateway_incarnation != self.gateway_incarnation:
            log.warning("registry.forgotten", gateway=self.gateway, worker_id=self.worker_id, known=resp.known,
                        gateway_restarted=resp.gateway_incarnation != self.gateway_incarnation)
            self.worker_id = None
            await self.register()

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self.beat_once()
            except grpc.aio.AioRpcError as exc:
                log.warning("registry.heartbeat_failed", gateway=self.gateway, code=exc.code().name,
                            details=exc.details())
            except Exception:  # noqa: BLE001 - keep beating; never die silently
                log.exception("registry.heartbeat_error", gateway=self.gateway)
            if self.kv_events is not None:
                await self.kv_events.wait(self.period_s)
            else:
                await asyncio.sleep(self.period_s)

    async def _stop_beating(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def stop(self) -> None:
        await self._stop_beating()
        await self._channel.close()

    async def leave(self) -> None:
        """This gateway is no longer named by the discovery source: stop beating, and tell it
        (when it knows us) that we are draining, so it routes nothing new here while the
        streams it has on us finish. It drops us after its missed beats."""
        await self._stop_beating()
        if self.worker_id is not None:
            self.state = common_pb2.WORKER_STATE_DRAINING
            request = gateway_pb2.HeartbeatRequest(worker_id=self.worker_id, load=self._load(), state=self.state,
                                                   incarnation=self.incarnation)
            try:
                await self._stub().Heartbeat(request, timeout=1.0)
            except grpc.aio.AioRpcError as exc:
                log.info("registry.leave_unsent", gateway=self.gateway, code=exc.code().name)
        await self._channel.close()


class Registrations:
    """One ``RegistrationClient`` per gateway the discovery source names (``plumbing/discovery.py``),
    kept in step with it: the source is asked every ``refresh_s``; a gateway it names anew is
    registered with (its own KV-event log, a branch of the engine's, starts with the whole
    cache); one it no longer names is left (``RegistrationClient.leave``). A source that could
    not be asked changes nothing. Event-loop owned."""

    def __init__(self, source: GatewaySource, make_client: Callable[[str, KVEventSender | None], RegistrationClient],
                 tee: KVEventTee | None, refresh_s: float) -> None:
        self.source = source
        self.clients: dict[str, RegistrationClient] = {}
        self._make = make_client
        self._tee = tee
        self._refresh_s = refresh_s
        self._state = common_pb2.WORKER_STATE_SERVING
        self._task: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[None]] = set()

    @property
    def state(self) -> int:
        return self._state

    @state.setter
    def state(self, value: int) -> None:
        """What every heartbeat reports from now on (DRAINING: route nothing new here)."""
        self._state = value
        for client in self.clients.values():
            client.state = value

    async def refresh(self) -> None:
        try:
            wanted = set(await self.source.resolve())
        except DiscoveryError as exc:
            log.warning("discovery.failed", source=self.source.describe, error=str(exc))
            return
        for address in sorted(wanted - self.clients.keys()):
            self._join(address)
        for address in sorted(self.clients.keys() - wanted):
            self._leave(address)

    def _join(self, address: str) -> None:
        sender = KVEventSender(self._tee.branch()) if self._tee is not None else None
        client = self._make(address, sender)
        client.state = self._state
        self.clients[address] = client
        client.start()
        log.info("discovery.gateway_joined", gateway=address, num_gateways=len(self.clients))

    def _leave(self, address: str) -> None:
        client = self.clients.pop(address)
        log.info("discovery.gateway_left", gateway=address, num_gateways=len(self.clients))
        if self._tee is not None and client.kv_events is not None:
            self._tee.prune(client.kv_events.log)
        task = asyncio.get_running_loop().create_task(client.leave())
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep following; never die silently
                log.exception("discovery.error", source=self.source.describe)
            await asyncio.sleep(self._refresh_s)

    async def beat_once(self) -> None:
        """One heartbeat to every gateway now (the drain: DRAINING reaches all of them)."""
        await asyncio.gather(*(c.beat_once() for c in self.clients.values()), return_exceptions=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._leaving, *(c.stop() for c in self.clients.values()), return_exceptions=True)
