"""Run the gateway: Gateway + WorkerRegistry services, health, reflection, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from engine.models.spec import load_model_spec, load_tokenizer, resolve_max_model_len
from gateway.prompt import max_token_bytes
from gateway.registry import Registry
from gateway.service import GatewayService
from gateway.validation import Limits
from plumbing import rpc
from plumbing.config import GatewayConfig
from plumbing.logs import adopt_library_loggers, install_loop_exception_handler
from plumbing.metrics import GatewayMetrics, serve_metrics
from splitserve.v1 import common_pb2, gateway_pb2_grpc

log = structlog.get_logger()
SERVICE_NAMES = ["splitserve.v1.Gateway", "splitserve.v1.WorkerRegistry"]


def model_limits(config: GatewayConfig, tokenizer: object | None) -> Limits:
    spec = load_model_spec(config.model)
    max_model_len = resolve_max_model_len(config.max_model_len, spec)
    return Limits(spec.vocab_size, max_model_len, config.max_stop_strings, config.max_stop_string_bytes,
                  max_token_bytes(tokenizer))


async def serve_gateway(config: GatewayConfig) -> None:
    install_loop_exception_handler()
    tokenizer = load_tokenizer(config.model)
    adopt_library_loggers()  # transformers attached its own stderr handler on import
    limits = model_limits(config, tokenizer)
    model_name = Path(config.model).name
    metrics = GatewayMetrics.create()
    registry = Registry(model_name, config.heartbeat_period_ms, config.heartbeat_miss_count,
                        startup_grace_s=config.startup_grace_s, routing=config.routing,
                        routing_metrics=metrics.routing)
    service = GatewayService(config, registry, tokenizer, limits, metrics, model_name)
    server = rpc.make_server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
    gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(registry, server)
    health = rpc.add_health_and_reflection(server, SERVICE_NAMES)
    address = rpc.bind_port(server, config.server.host, config.server.port)
    await server.start()
    registry.start()
    metrics_port = serve_metrics(metrics.registry, config.server.host, config.server.metrics_port)
    await rpc.set_serving(health, SERVICE_NAMES, False)  # until workers registered (or the grace ran out)
    ready = asyncio.ensure_future(_serving_once_registered(registry, health, config.startup_grace_s))
    log.info("gateway.listening", address=address, metrics_port=metrics_port, model=model_name,
             max_model_len=limits.max_model_len, max_prompt_bytes=limits.max_prompt_bytes,
             incarnation=registry.incarnation)
    if config.server.ready_file:
        Path(config.server.ready_file).write_text(address)
    await rpc.wait_for_signal()
    ready.cancel()
    log.info("gateway.draining", in_flight=service.num_in_flight)
    await rpc.set_serving(health, SERVICE_NAMES, False)
    await server.stop(config.server.drain_timeout_s)
    await registry.stop()
    service.close()
    log.info("gateway.stopped")


async def _serving_once_registered(registry: Registry, health: object, grace_s: float) -> None:
    """Health turns SERVING once a decode worker registered, or when the grace has passed."""
    await registry.wait_for_decode(grace_s)
    await rpc.set_serving(health, SERVICE_NAMES, True)  # type: ignore[arg-type]
    log.info("gateway.serving", decode_workers=len(registry.live(common_pb2.WORKER_ROLE_DECODE)))
