"""What both workers share: the engine on its engine thread, per-request output queues, load
reports, metrics, registration with the gateway, and the serve/drain lifecycle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from engine import cpu_tuning
from engine.engine import Engine
from engine.engine_thread import EngineStopped, EngineThread
from engine.outputs import EngineLoad, RequestOutput
from engine.prompt_check import check_prompt
from plumbing import rpc
from plumbing.config import WorkerConfig
from plumbing.convert import kv_layout_to_proto
from plumbing.identity import mint_id
from plumbing.discovery import join_host_port, parse_source
from plumbing.kv_event_sender import KVEventSender, KVEventTee
from plumbing.logs import adopt_library_loggers, install_loop_exception_handler
from plumbing.grammar_metrics import register_grammar_metrics
from plumbing.metrics import WorkerMetrics, serve_metrics
from plumbing.registration import RegistrationClient, Registrations
from plumbing.security import Security
from plumbing.servers import INTERNAL, Servers, write_ready_file
from splitserve_api.v1 import common_pb2

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
        register_grammar_metrics(self.metrics.registry, lambda: engine.grammars.stats if engine.grammars else None,
                                 {"role": self.role_name})
        self.security = Security.from_config(config.server.security)
        self.channel_security = self.security.channels()  # every client channel of this process
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        # Request id -> its current stream, done once the stream ended and its cleanup ran.
        self._streams: dict[str, asyncio.Future[None]] = {}
        self.engine_thread = EngineThread(engine, self._on_outputs_threadsafe, on_tick=self.on_tick,
                               on_failure=self._on_engine_failure, on_step=self.metrics.observe_step)
        self.registration: Registrations | None = None

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

    def check_prompt(self, prompt: list[int], num_prior_output_tokens: int) -> None:
        """At the worker's edge: the prompt rule (``engine/prompt_check.py``) on
        ``prompt_token_ids``, and fewer tokens generated elsewhere at its end
        (``num_prior_output_tokens``, a migration) than it has."""
        check_prompt(prompt, self.engine.spec.vocab_size, self.engine.max_model_len, "prompt_token_ids")
        if num_prior_output_tokens >= len(prompt):
            raise ValueError(f"num_prior_output_tokens={num_prior_output_tokens} must be below the prompt's "
                             f"length {len(prompt)}")

    # -- one stream per request id at a time ------------------------------------------
    async def open_stream(self, rid: str, what: str, wait_s: float = 2.0) -> asyncio.Queue[Any]:
        """The output queue of a new stream for ``rid``. An earlier stream for the same id (a
        retry reached this worker while the previous attempt was being torn down) is waited
        for, up to ``wait_s``, until it ended and the engine thread ran its cleanup: outputs
        the engine made for that attempt reach the loop before the cleanup's completion does,
        so they find no queue and are dropped, never delivered to this stream."""
        previous = self._streams.get(rid)
        if previous is not None:
            try:
                await asyncio.wait_for(asyncio.shield(previous), wait_s)
            except TimeoutError:
                raise ValueError(f"request_id {rid} is already being {what} here") from None
            if rid in self._streams:  # another stream for the id got here first
                raise ValueError(f"request_id {rid} is already being {what} here")
        self._streams[rid] = self.loop.create_future()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[rid] = queue
        return queue

    def close_stream(self, rid: str, cleanup: Callable[[Engine], Any] | None) -> None:
        """End the stream for ``rid``: its outputs stop being delivered now; ``cleanup`` (free
        what the request holds) runs on the engine thread, and the id is free again after it."""
        self.queues.pop(rid, None)
        done = self._streams.get(rid)

        def settle() -> None:
            if done is not None and self._streams.get(rid) is done:
                del self._streams[rid]
            if done is not None and not done.done():
                done.set_result(None)

        if cleanup is None:
            settle()
            return
        self.engine_thread.call(cleanup).add_done_callback(lambda _: self.loop.call_soon_threadsafe(settle))

    def push_threadsafe(self, request_id: str, item: Any) -> None:
        """Hand ``item`` (an output or an exception) to a request's stream from any thread."""
        def put() -> None:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(item)

        self.loop.call_soon_threadsafe(put)

    def blocks_in_transfer(self) -> int:
        """KV blocks held for (prefill) or reserved by (decode) transfers, as the engine
        thread last published them; any thread."""
        return self.engine_thread.load.num_blocks_in_transfer

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
        self.metrics.kv_cache_usage.set(1 - load.num_blocks_free / load.num_blocks_total if load.num_blocks_total else 0)
        self.metrics.kv_blocks_in_transfer.set(in_transfer)
        self.metrics.running.set(load.num_running)
        self.metrics.waiting.set(load.num_waiting)
        if load.spec is not None:
            self.metrics.observe_spec(load.spec)
        self.metrics.observe_totals(load.num_cached_prompt_tokens, load.num_received_prompt_tokens)
        return common_pb2.WorkerLoad(
            kv_blocks_total=load.num_blocks_total, kv_blocks_free=load.num_blocks_free,
            kv_blocks_in_transfer=in_transfer, num_running=load.num_running,
            num_waiting=load.num_waiting, num_queued_prefill_tokens=load.num_queued_prefill_tokens,
            num_cached_prompt_tokens=load.num_cached_prompt_tokens,
            num_received_prompt_tokens=load.num_received_prompt_tokens,
        )

    def load_snapshot(self) -> common_pb2.WorkerLoad:
        """The load the engine thread last published (heartbeats; touches no engine state)."""
        return self._report(self.engine_thread.load)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        """Exact load, taken on the engine thread between steps."""
        return self._report(await self.on_engine_thread(lambda e: e.load()))


def _registrations(config: WorkerConfig, worker: EngineServicer, public: str, tee: KVEventTee) -> Registrations:
    """Registration with every gateway ``--gateway`` names, each with its branch of the KV events."""
    engine = worker.engine

    def client(gateway: str, kv_events: KVEventSender | None) -> RegistrationClient:
        return RegistrationClient(
            gateway, worker.role, public, Path(config.engine.model).name, kv_layout_to_proto(engine.kv_layout),
            worker.load_snapshot, worker.incarnation, security=worker.channel_security, kv_events=kv_events,
            quantization=config.engine.quantization_name, batch_invariant=config.engine.batch_invariant,
        )

    return Registrations(parse_source(config.gateway), client, tee, config.gateway_refresh_s)


async def serve_worker(
    config: WorkerConfig,
    make_worker: Callable[[WorkerConfig, Engine], EngineServicer],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
) -> None:
    """Build the engine, serve until SIGTERM/SIGINT, then drain and exit.

    A worker has only internal RPCs: its ``--port`` is an internal surface (mTLS and/or the
    shared secret, ``plumbing/servers.py``); ``--health-port`` serves probes."""
    install_loop_exception_handler()
    started = time.monotonic()
    # Built on a passing thread, so that only the engine thread keeps an OpenMP team.
    engine = cpu_tuning.on_passing_thread(lambda: Engine(config.engine))
    load_s = time.monotonic() - started  # model load and engine set-up: the cold start's main part
    if config.fault_nan_token is not None:
        if not 0 <= config.fault_nan_token < engine.spec.vocab_size:
            raise ValueError(f"--fault-nan-token must be a token id below {engine.spec.vocab_size}, "
                             f"got {config.fault_nan_token}")
        log.warning("worker.fault_nan_token", token_id=config.fault_nan_token)
        model = engine.runner.model
        model.embed = model.embed.clone()  # its own copy: a head tied to it stays clean
        model.embed[config.fault_nan_token] = float("nan")
    adopt_library_loggers()  # transformers attached its own stderr handler on import
    worker = make_worker(config, engine)
    tee = KVEventTee.install(engine.kv.pool)  # one KV-event log per gateway, before the engine runs
    worker.engine_thread.start()
    servers = Servers(worker.security, worker.metrics.count_auth_failure)
    address = servers.add(INTERNAL, config.server.host, config.server.port,
                          [lambda server: add_to_server(worker, server)], [service_name])
    health_address = servers.add_health(config.server.host, config.server.health_port)
    public = f"{config.server.public_host}:{address.rsplit(':', 1)[1]}"
    await servers.start()
    metrics_port = serve_metrics(worker.metrics.registry, config.server.host, config.server.metrics_port,
                                 {"model": Path(config.engine.model).name})
    await servers.set_serving(True)
    worker.registration = _registrations(config, worker, public, tee)
    worker.registration.start()
    reloads = asyncio.ensure_future(worker.security.watch())
    log.info("worker.serving", role=worker.role_name, address=public, health_address=health_address,
             metrics_port=metrics_port, kv_blocks=engine.kv.num_blocks, engine_load_s=round(load_s, 3),
             **worker.security.describe())
    if config.server.ready_file:
        write_ready_file(config.server.ready_file, {
            "public": public, "health": health_address,
            "metrics": None if metrics_port is None else join_host_port(config.server.host, metrics_port)})
    await rpc.wait_for_signal()
    log.info("worker.draining", role=worker.role_name, grace_s=config.server.drain_grace_s)
    worker.registration.state = common_pb2.WORKER_STATE_DRAINING
    try:
        await worker.registration.beat_once()  # the gateways route nothing new here from now on
    except grpc.aio.AioRpcError:
        pass
    await servers.drain(config.server.drain_grace_s, config.server.drain_timeout_s)
    reloads.cancel()
    await worker.registration.stop()
    worker.engine_thread.stop()
    log.info("worker.stopped", role=worker.role_name)

