"""Worker side of the registry: register with the gateway, then heartbeat until stopped.

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
from plumbing.kv_event_sender import KVEventSender
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

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
    ) -> None:
        # The gateway's internal port: mTLS and/or the shared secret (plumbing/channels.py).
        self._channel = PeerChannel(gateway_address, security or ChannelSecurity())
        self._role = role
        self._address = address
        self._model = model
        self._layout = kv_layout
        self._quantization = quantization
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
                quantization=self._quantization,
            ),
            timeout=5.0,
        )
        self.worker_id = resp.worker_id
        self.gateway_incarnation = resp.gateway_incarnation
        self.period_s = max(resp.heartbeat_period_ms, 10) / 1000.0
        if self.kv_events is not None:
            self.kv_events.configure(resp)
        log.info("registry.registered", worker_id=self.worker_id, period_s=self.period_s)
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
            log.warning("registry.forgotten", worker_id=self.worker_id, known=resp.known,
                        gateway_restarted=resp.gateway_incarnation != self.gateway_incarnation)
            self.worker_id = None
            await self.register()

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self.beat_once()
            except grpc.aio.AioRpcError as exc:
                log.warning("registry.heartbeat_failed", code=exc.code().name, details=exc.details())
            except Exception:  # noqa: BLE001 - keep beating; never die silently
                log.exception("registry.heartbeat_error")
            if self.kv_events is not None:
                await self.kv_events.wait(self.period_s)
            else:
                await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._channel.close()
