"""What both workers share: the engine on its engine thread, per-request output queues, load
reports, metrics, registration with the gateway, and the serve/drain lifecycle."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from engine.engine import Engine
from engine.engine_thread import EngineStopped, EngineThread
from engine.outputs import EngineLoad, RequestOutput
from plumbing import rpc
from plumbing.config import WorkerConfig
from plumbing.convert import kv_layout_to_proto
from plumbing.identity import mint_id
from plumbing.kv_event_sender import KVEventSender
from plumbing.logs import adopt_library_loggers, install_loop_exception_handler
from plumbing.metrics import WorkerMetrics, serve_metrics
from plumbing.registration import RegistrationClient
from splitserve.v1 import common_pb2

T = TypeVar("T")
log = structlog.get_logger()


class EngineServicer:
    """Owns the engine thread; subclasses add the gRPC methods of their role."""

    role: int = common_pb2.WORKER_ROLE_UNSPECIFIED
    role_name = "worker"

    def __init__(self, config: WorkerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.incarnation = mint_id()  # this process start (plumbing.identity)
        self.metrics = WorkerMetrics.create(self.role_name)
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.engine_thread = EngineThread(engine, self._on_outputs_threadsafe, on_tick=self.on_tick,
                               on_failure=self._on_engine_failure)
        self.registration: RegistrationClient | None = None

    # -- engine thread -> event loop -------------------------------------------------
    def _on_outputs_threadsafe(self, outputs: list[RequestOutput]) -> None:
        self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.metrics.generated_tokens.inc(len(out.new_token_ids))
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_engine_failure(self, exc: BaseException) -> None:
        """Engine thread: the engine is unusable. Fail every stream now (never a hang) and
        report DRAINING so the gateway routes nothing new here."""
        def fail_all() -> None:
            error = rpc.ServiceError(grpc.StatusCode.INTERNAL, f"engine failed: {exc}")
            for queue in self.queues.values():
                queue.put_nowait(error)
            if self.registration is not None:
                self.registration.state = common_pb2.WORKER_STATE_DRAINING

        self.loop.call_soon_threadsafe(fail_all)

    def push_threadsafe(self, request_id: str, item: Any) -> None:
        """Hand ``item`` (an output or an exception) to a request's stream from any thread."""
        def put() -> None:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(item)

        self.loop.call_soon_threadsafe(put)

    def blocks_in_transfer(self) -> int:
        """KV blocks held for (prefill) or reserved by (decode) transfers; any thread."""
        return 0

    def on_tick(self, engine: Engine) -> None:
        """Engine-thread housekeeping between steps (leases); default none."""

    async def on_engine_thread(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and await its result."""
        try:
            return await asyncio.wrap_future(self.engine_thread.call(fn))
        except EngineStopped:
            raise rpc.ServiceError(grpc.StatusCode.UNAVAILABLE, "this worker's engine is stopped") from None

    # -- load -------------------------------------------------------------------------
    def _report(self, load: EngineLoad) -> common_pb2.WorkerLoad:
        """``load`` as the proto, with the blocks in transfer; updates the gauges."""
        in_transfer = self.blocks_in_transfer()
        self.metrics.kv_blocks_free.set(load.num_blocks_free)
        self.metrics.kv_blocks_used.set(load.num_blocks_total - load.num_blocks_free)
        self.metrics.kv_blocks_in_transfer.set(in_transfer)
        self.metrics.running.set(load.num_running)
        self.metrics.waiting.set(load.num_waiting)
        if load.spec is not None:
            self.metrics.observe_spec(load.spec)
        return common_pb2.WorkerLoad(
            kv_blocks_total=load.num_blocks_total, kv_blocks_free=load.num_blocks_free,
            kv_blocks_in_transfer=in_transfer, num_running=load.num_running,
            num_waiting=load.num_waiting, num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        )

    def load_snapshot(self) -> common_pb2.WorkerLoad:
        """The load the engine thread last published (heartbeats; touches no engine state)."""
        return self._report(self.engine_thread.load)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        """Exact load, taken on the engine thread between steps."""
        return self._report(await self.on_engine_thread(lambda e: e.load()))


async def serve_worker(
    config: WorkerConfig,
    make_worker: Callable[[WorkerConfig, Engine], EngineServicer],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
) -> None:
    """Build the engine, serve until SIGTERM/SIGINT, then drain and exit."""
    install_loop_exception_handler()
    engine = Engine(config.engine)
    adopt_library_loggers()  # transformers attached its own stderr handler on import
    worker = make_worker(config, engine)
    worker.engine_thread.start()
    server = rpc.make_server()
    add_to_server(worker, server)
    health = rpc.add_health_and_reflection(server, [service_name])
    address = rpc.bind_port(server, config.server.host, config.server.port)
    public = f"{config.server.public_host}:{address.rsplit(':', 1)[1]}"
    await server.start()
    metrics_port = serve_metrics(worker.metrics.registry, config.server.host, config.server.metrics_port)
    await rpc.set_serving(health, [service_name], True)
    worker.registration = RegistrationClient(
        config.gateway, worker.role, public, Path(config.engine.model).name,
        kv_layout_to_proto(engine.kv_layout), worker.load_snapshot, worker.incarnation,
        KVEventSender(engine.kv_events),
    )
    worker.registration.start()
    log.info("worker.serving", role=worker.role_name, address=public, metrics_port=metrics_port,
             kv_blocks=engine.kv.num_blocks)
    if config.server.ready_file:
        Path(config.server.ready_file).write_text(public)
    await rpc.wait_for_signal()
    log.info("worker.draining", role=worker.role_name)
    await rpc.set_serving(health, [service_name], False)
    worker.registration.state = common_pb2.WORKER_STATE_DRAINING
    try:
        await worker.registration.beat_once()
    except grpc.aio.AioRpcError:
        pass
    await server.stop(config.server.drain_timeout_s)
    await worker.registration.stop()
    worker.engine_thread.stop()
    log.info("worker.stopped", role=worker.role_name)
