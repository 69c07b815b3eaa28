"""Run the gateway: the public Gateway service, the internal WorkerRegistry, health, reflection, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from engine.models.spec import eos_token_ids, load_model_spec, load_tokenizer, resolve_max_model_len
from gateway.prompt import max_token_bytes
from gateway.registry import Registry
from gateway.service import GatewayService
from gateway.validation import Limits
from plumbing import rpc
from plumbing.config import GatewayConfig
from plumbing.discovery import join_host_port
from plumbing.logs import adopt_library_loggers, install_loop_exception_handler
from plumbing.grammar_metrics import register_grammar_metrics
from plumbing.metrics import GatewayMetrics, serve_metrics
from plumbing.security import Security
from plumbing.servers import INTERNAL, PUBLIC, Servers, write_ready_file
from splitserve_api.v1 import common_pb2, gateway_pb2_grpc

log = structlog.get_logger()
GATEWAY, REGISTRY = "splitserve.v1.Gateway", "splitserve.v1.WorkerRegistry"


def model_limits(config: GatewayConfig, tokenizer: object | None) -> Limits:
    spec = load_model_spec(config.model)
    max_model_len = resolve_max_model_len(config.max_model_len, spec)
    return Limits(spec.vocab_size, max_model_len, config.max_stop_strings, config.max_stop_string_bytes,
                  max_token_bytes(tokenizer), eos_token_ids(config.model, spec))


async def serve_gateway(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain (``plumbing/servers.py``) and return.

    Two surfaces: the public API on ``--port`` (TLS, API keys) and the worker registry on
    ``--internal-port`` (mTLS and/or the shared secret); never the registry on the public port."""
    install_loop_exception_handler()
    tokenizer = load_tokenizer(config.model)
    adopt_library_loggers()  # transformers attached its own stderr handler on import
    limits = model_limits(config, tokenizer)
    model_name = Path(config.model).name
    metrics = GatewayMetrics.create()
    security = Security.from_config(config.server.security)
    registry = Registry(model_name, config.heartbeat_period_ms, config.heartbeat_miss_count,
                        startup_grace_s=config.startup_grace_s, security=security.channels(),
                        routing=config.routing, routing_metrics=metrics.routing)
    metrics.count_workers(registry.num_serving)
    service = GatewayService(config, registry, tokenizer, limits, metrics, model_name)
    register_grammar_metrics(metrics.registry, lambda: service.grammars.stats if service.grammars else None)
    servers = Servers(security, metrics.count_auth_failure)
    host = config.server.host
    address = servers.add(PUBLIC, host, config.server.port,
                          [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(service, s)], [GATEWAY])
    internal = servers.add(INTERNAL, host, config.internal_port,
                           [lambda s: gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(registry, s)], [REGISTRY])
    health_address = servers.add_health(host, config.server.health_port)
    await servers.start()
    registry.start()
    metrics_port = serve_metrics(metrics.registry, host, config.server.metrics_port, {"model": model_name})
    await servers.set_serving(False)  # until workers registered (or the grace ran out)
    ready = asyncio.ensure_future(_serving_once_registered(registry, servers, config.startup_grace_s))
    reloads = asyncio.ensure_future(security.watch())
    log.info("gateway.listening", address=address, internal_address=internal, health_address=health_address,
             metrics_port=metrics_port, model=model_name, max_model_len=limits.max_model_len,
             max_prompt_bytes=limits.max_prompt_bytes, incarnation=registry.incarnation, **security.describe())
    if config.server.ready_file:
        write_ready_file(config.server.ready_file, {
            "public": address, "internal": internal, "health": health_address,
            "metrics": None if metrics_port is None else join_host_port(host, metrics_port)})
    await rpc.wait_for_signal()
    ready.cancel()
    log.info("gateway.draining", in_flight=service.num_in_flight, grace_s=config.server.drain_grace_s)
    await servers.drain(config.server.drain_grace_s, config.server.drain_timeout_s)
    reloads.cancel()
    await registry.stop()
    service.close()
    log.info("gateway.stopped")


async def _serving_once_registered(registry: Registry, servers: Servers, grace_s: float) -> None:
    """Health turns SERVING once a decode worker registered, or when the grace has passed."""
    await registry.wait_for_decode(grace_s)
    await servers.set_serving(True)
    log.info("gateway.serving", decode_workers=len(registry.live(common_pb2.WORKER_ROLE_DECODE)))
