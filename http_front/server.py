"""Run the HTTP front (``splitserve http``): uvicorn serving ``http_front/app.py`` on its own
port, one gRPC channel to the gateway's public port.

Its own process rather than a port of the gateway's: the gateway's event loop also answers
the workers' heartbeats and must stay short (docs/architecture.md, "Tokenizing off the event
loop"); JSON and SSE framing per token would sit on it. As a separate process the front
scales and restarts on its own, and it is a client like any other: the gateway's validation,
routing, stop strings, retries, migration and API keys apply to it unchanged. The price is a
loopback hop per chunk (``python -m bench.http_vs_grpc`` measures it).
"""

from __future__ import annotations

import socket

import grpc
import structlog
import uvicorn

from http_front.app import Front, Gateway
from http_front.config import HttpConfig
from http_front.metrics import FrontMetrics
from plumbing import tracing
from plumbing.auth import bearer_metadata
from plumbing.logs import install_loop_exception_handler
from plumbing.resume import LOAD_BALANCING, gateway_target
from plumbing.rpc import channel_options
from plumbing.servers import write_ready_file
from plumbing.tls import load_material

log = structlog.get_logger()


def gateway_channel(config: HttpConfig) -> grpc.aio.Channel:
    """The channel to every gateway the address names (round-robin); its send limit follows
    ``--max-body-bytes``."""
    options = [o for o in channel_options() if o[0] != "grpc.max_send_message_length"]
    options += [("grpc.max_send_message_length", config.max_send_bytes), *LOAD_BALANCING]
    target = gateway_target(config.gateway)
    if config.tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=tracing.client_interceptors())
    m = load_material(config.tls)
    if config.tls.server_name:
        options.append(("grpc.ssl_target_name_override", config.tls.server_name))
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(m.ca, m.key, m.cert), options=options,
                                   interceptors=tracing.client_interceptors())


def _bind(host: str, port: int) -> socket.socket:
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # without it each SSE event after the first waits out Nagle + delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)  # connections queue from here on, before uvicorn accepts them
    return sock


async def serve_http(config: HttpConfig) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's handlers: stop accepting, let requests finish)."""
    install_loop_exception_handler()
    channel = gateway_channel(config)
    gateway = Gateway(channel, bearer_metadata(config.token), config.timeout_s, resume=config.resume)
    front = Front(gateway, FrontMetrics.create(), config.default_max_tokens, config.max_body_bytes)
    sock = _bind(config.host, config.port)
    address = f"{config.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(front.app(), log_config=None, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=30))
    log.info("http.listening", address=address, gateway=config.gateway)
    if config.ready_file:
        write_ready_file(config.ready_file, {"public": address})
    try:
        await server.serve(sockets=[sock])
    finally:
        await channel.close()
        log.info("http.stopped")
