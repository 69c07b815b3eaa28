"""The worker registry: registration, heartbeats, liveness, and the routing choices.

One owner: the gateway's event loop (no locks). A worker that misses
``heartbeat_miss_count`` periods is dropped by the sweeper; a worker whose RPC fails with
UNAVAILABLE with a lost connection is dropped at once (``drop``). Routing reads the last reported load plus
what this gateway routed since (so a burst does not all land on one worker).

Identity (``docs/architecture.md``, "Identities"): the registry has an incarnation of its
own (told to workers, so they notice a gateway restart), mints a random worker id per
registration, and binds it to the worker's incarnation: a heartbeat counts only for that
pair. One entry per address: a registration replaces the one made at its address before (a
restarted worker). What workers report is checked (``gateway/reports.py``).

KV-aware routing (``gateway/routing.py``, the ``router``): each entry keeps a prefix index
(``gateway/prefix_index.py``) that the worker's heartbeats feed with KV events, when the
routing policy wants them (the registration answer tells the worker). A new registration
starts from an empty index, so a restarted worker's stale entries die with its old entry.

After a (re)start the gateway waits for registrations: until a decode worker registered, or
``startup_grace_s`` passed, it is not ready (health NOT_SERVING; requests wait for a decode
worker within the grace instead of failing at once).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from gateway.prefix_index import PrefixIndex
from gateway.reports import check_kv_events, check_load, check_quantization, check_state
from gateway.routing import Router
from gateway.workers import WorkerEntry
from plumbing.config import RoutingConfig
from plumbing.identity import mint_id
from plumbing.channels import ChannelSecurity, PeerChannel
from plumbing.metrics import RoutingMetrics
from splitserve_api.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)

log = structlog.get_logger()


class Registry(gateway_pb2_grpc.WorkerRegistryServicer):
    def __init__(self, model: str, heartbeat_period_ms: int, heartbeat_miss_count: int,
                 incarnation: int | None = None, startup_grace_s: float = 0.0,
                 security: ChannelSecurity | None = None, routing: RoutingConfig | None = None,
                 routing_metrics: RoutingMetrics | None = None) -> None:
        self.model = model
        self.security = security or ChannelSecurity()  # how the gateway dials workers
        self.router = Router(self.live, routing or RoutingConfig(), routing_metrics)
        self.incarnation = incarnation or mint_id()
        self._startup_ends = time.monotonic() + startup_grace_s
        self._decode_seen = False  # a decode worker registered since this gateway started
        self._decode_waiters: list[asyncio.Future[None]] = []
        self.period_ms = heartbeat_period_ms
        self.miss_count = heartbeat_miss_count
        self.workers: dict[int, WorkerEntry] = {}
        # Dropped workers whose gRPC channel still carries routed requests: closing it would
        # cancel those streams under the handler, so it is closed once they are done.
        self._retired: list[WorkerEntry] = []
        self._sweeper: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    # -- RPCs ---------------------------------------------------------------------------
    async def RegisterWorker(
        self, request: gateway_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RegisterWorkerResponse:
        if request.role not in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
            raise ValueError(f"role must be WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE, got {request.role}")
        if not request.address:
            raise ValueError("address must be host:port")
        if request.model != self.model:
            raise ValueError(f"model: worker serves {request.model!r}, gateway serves {self.model!r}")
        if not request.incarnation:
            raise ValueError("incarnation must be set (the worker process's incarnation)")
        check_load(request.load, "load")
        quantization = check_quantization(request.quantization, "quantization")
        # Pages computed with other weights than the decode worker continues with would give
        # a wrong reply without an error: one quantization per deployment, like one model.
        others = {w.quantization for w in self.workers.values() if w.address != request.address}
        if others and others != {quantization}:
            raise ValueError(f"quantization: worker runs {quantization!r}, the registered workers run "
                             f"{sorted(others)!r}")
        # A stream continued on another worker (a migration, a resumed stream) goes on bit for
        # bit only if both run --batch-invariant: a cluster that mixes them would keep that
        # promise for some streams and silently not for others.
        settings = {w.batch_invariant for w in self.workers.values() if w.address != request.address}
        if settings and settings != {request.batch_invariant}:
            raise ValueError(f"batch_invariant: worker runs {request.batch_invariant}, the registered workers run "
                             f"{not request.batch_invariant}")
        for old in [w for w in self.workers.values() if w.address == request.address]:
            self.drop(old.worker_id, "another process registered at its address")
        channel = PeerChannel(request.address, self.security)
        stub_type = (
            decode_pb2_grpc.DecodeWorkerStub
            if request.role == common_pb2.WORKER_ROLE_DECODE
            else prefill_pb2_grpc.PrefillWorkerStub
        )
        worker_id = mint_id()
        while worker_id in self.workers:
            worker_id = mint_id()
        entry = WorkerEntry(worker_id, request.role, request.address, channel, stub_type,
                            request.load, request.incarnation,
                            prefix=PrefixIndex(request.kv_layout.block_size, request.load.kv_blocks_total),
                            quantization=quantization, kv_layout=request.kv_layout,
                            batch_invariant=request.batch_invariant)
        self.workers[worker_id] = entry
        self.changed.set()
        if request.role == common_pb2.WORKER_ROLE_DECODE:
            self._decode_seen = True
            for waiter in self._decode_waiters:
                if not waiter.done():
                    waiter.set_result(None)
        log.info("registry.worker_joined", worker_id=worker_id,
                 role=common_pb2.WorkerRole.Name(request.role), address=request.address)
        routing = self.router.config
        return gateway_pb2.RegisterWorkerResponse(
            worker_id=worker_id, heartbeat_period_ms=self.period_ms, gateway_incarnation=self.incarnation,
            kv_events_max_per_beat=self.kv_events_max_per_beat, kv_events_interval_ms=routing.kv_events_interval_ms)

    @property
    def kv_events_max_per_beat(self) -> int:
        """What a heartbeat may carry in ``kv_events`` (0: the routing policy wants none)."""
        routing = self.router.config
        return routing.kv_events_max_per_beat if routing.wants_kv_events else 0

    async def Heartbeat(
        self, request: gateway_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.HeartbeatResponse:
        entry = self.workers.get(request.worker_id)
        if entry is None or entry.incarnation != request.incarnation:
            return gateway_pb2.HeartbeatResponse(known=False, gateway_incarnation=self.incarnation)
        check_load(request.load, "load", entry.load.kv_blocks_total)
        state = check_state(request.state)
        events = request.kv_events if request.HasField("kv_events") else None
        if events is not None:
            check_kv_events(events, "kv_events", self.kv_events_max_per_beat)
            entry.prefix.check(events, "kv_events")
            entry.prefix.apply(events)
        entry.state = state
        entry.load = request.load
        entry.last_beat = time.monotonic()
        return gateway_pb2.HeartbeatResponse(known=True, gateway_incarnation=self.incarnation)

    # -- startup ------------------------------------------------------------------------
    def startup_left_s(self) -> float:
        """Seconds of the startup grace left while no decode worker has registered; 0 after."""
        return 0.0 if self._decode_seen else max(0.0, self._startup_ends - time.monotonic())

    async def wait_for_decode(self, timeout_s: float) -> None:
        """Return once a decode worker has registered since the start, or after ``timeout_s``."""
        if self._decode_seen or timeout_s <= 0:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decode_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._decode_waiters.remove(waiter)

    # -- liveness -----------------------------------------------------------------------
    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        limit = self.period_ms * self.miss_count / 1000.0
        while True:
            await asyncio.sleep(self.period_ms / 1000.0)
            now = time.monotonic()
            for entry in list(self.workers.values()):
                if now - entry.last_beat > limit:
                    self.drop(entry.worker_id, f"no heartbeat for {now - entry.last_beat:.2f} s")
            self._close_idle_retired()

    def drop(self, worker_id: int, reason: str) -> None:
        """Stop routing to a worker. Requests already on it keep their streams (a slow worker
        finishes them; a dead one fails them by itself); its channel closes once they end."""
        entry = self.workers.pop(worker_id, None)
        if entry is not None:
            log.warning("registry.worker_dropped", worker_id=worker_id, address=entry.address, reason=reason)
            self._retired.append(entry)
            self._close_idle_retired()

    def _close_idle_retired(self) -> None:
        busy = [e for e in self._retired if e.num_routed > 0 or e.num_routed_prefill_tokens > 0]
        for entry in self._retired:
            if entry not in busy:
                asyncio.get_running_loop().create_task(entry.channel.close())
        self._retired = busy

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for entry in [*self.workers.values(), *self._retired]:
            await entry.channel.close()

    # -- routing ------------------------------------------------------------------------
    def num_serving(self, role: str) -> int:
        """Serving workers of ``role`` ("prefill" or "decode"); safe from another thread (the
        metrics server's): the entries are copied in one step under the GIL, then only read."""
        wanted = common_pb2.WORKER_ROLE_DECODE if role == "decode" else common_pb2.WORKER_ROLE_PREFILL
        return sum(1 for w in list(self.workers.values())
                   if w.role == wanted and w.state == common_pb2.WORKER_STATE_SERVING)

    def live(self, role: int) -> list[WorkerEntry]:
        return [w for w in self.workers.values()
                if w.role == role and w.state == common_pb2.WORKER_STATE_SERVING]

    def pick_decode(self, exclude: set[int]) -> WorkerEntry | None:
        """The decode worker with the lowest KV load (used + routed-in-flight)."""
        candidates = [w for w in self.live(common_pb2.WORKER_ROLE_DECODE) if w.worker_id not in exclude]
        return min(candidates, key=lambda w: (w.kv_pressure(), w.worker_id), default=None)

    def pick_prefill(self, exclude: set[int]) -> WorkerEntry | None:
        """The prefill worker with the fewest queued prompt tokens (reported + routed)."""
        candidates = [w for w in self.live(common_pb2.WORKER_ROLE_PREFILL) if w.worker_id not in exclude]
        return min(
            candidates,
            key=lambda w: (w.load.num_queued_prefill_tokens + w.num_routed_prefill_tokens, w.worker_id),
            default=None,
        )

    def info(self) -> list[gateway_pb2.WorkerInfo]:
        now = time.monotonic()
        return [w.to_proto(now) for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
