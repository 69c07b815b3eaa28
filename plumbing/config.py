"""Service configuration: frozen dataclasses built once at the entry point.

Every flag ``--some-flag`` can also be set through ``SPLITSERVE_SOME_FLAG`` (flags win).
The environment is read when the parser is built inside ``main()``, never at import time.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass

from engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from engine.spec_decode.config import SpeculativeConfig
from plumbing.discovery import parse_source
from plumbing.flags import add_flag, byte_size, env_name  # noqa: F401 - re-exported (the CLI, tests, http_front)
from plumbing.routing_config import (  # noqa: F401 - re-exported
    ROUTING_POLICIES,
    RoutingConfig,
    add_routing_flags,
    routing_config,
)
from plumbing.tls import TlsConfig

TRANSPORTS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class SecurityConfig:
    """TLS and tokens (``plumbing/security.py``). Nothing set: plaintext, no tokens."""

    tls: TlsConfig = TlsConfig()
    api_keys: str | None = None  # gateway: accepted API keys, comma-separated
    api_keys_file: str | None = None  # gateway: accepted API keys, one a line
    internal_secret: str | None = None  # the shared secret of internal ports
    internal_secret_file: str | None = None
    # Serve internal ports on a non-loopback address with neither mTLS nor the shared secret
    # (refused otherwise: ServerConfig).
    insecure_internal: bool = False

    def __post_init__(self) -> None:
        if self.tls.ca_file is not None and not self.tls.enabled:
            raise ValueError("tls_ca needs tls_cert and tls_key: a service presents its own certificate (mTLS)")

    @property
    def authenticates_internal(self) -> bool:
        """Internal ports ask callers for mTLS or the shared secret."""
        return bool(self.internal_secret or self.internal_secret_file) or (self.tls.enabled and self.tls.mutual)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens and reports, how it is secured, how it drains."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port
    advertise_host: str | None = None  # what peers dial; default: host
    metrics_port: int = -1  # -1: no /metrics endpoint; 0: ephemeral
    health_port: int = -1  # plaintext grpc.health.v1 only (kubelet probes); -1: none
    ready_file: str | None = None  # "surface host:port" lines, written once serving (plumbing/servers.py)
    log_level: str = "info"
    # On SIGTERM: NOT_SERVING while still serving for drain_grace_s, then refuse new calls
    # and give in-flight ones drain_timeout_s to finish.
    drain_grace_s: float = 0.0
    drain_timeout_s: float = 10.0
    security: SecurityConfig = SecurityConfig()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("metrics_port", "health_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be -1 (off) or in [0, 65535], got {getattr(self, name)}")
        for name in ("drain_grace_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (is_loopback(self.host) or self.security.authenticates_internal or self.security.insecure_internal):
            raise ValueError(
                f"host {self.host} is not a loopback address and the internal port has no authentication: "
                "give --internal-secret-file (or --tls-cert, --tls-key and --tls-ca for mTLS), or "
                "--insecure-internal to serve it open to anyone who can reach it")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host


@dataclass(frozen=True)
class WorkerConfig:
    """A prefill or decode worker."""

    server: ServerConfig
    engine: EngineConfig
    gateway: str  # the gateways' registries: a discovery source (plumbing/discovery.py)
    gateway_refresh_s: float = 1.0  # ask the discovery source again this often
    transport: str = "auto"  # auto: nccl on CUDA, gloo otherwise
    kv_channel_timeout_s: float = 30.0  # one KV channel operation (one message), and one KV channel join
    max_lease_ms: int = 60_000  # cap on the lease a decode request may ask for
    max_reservations_per_request: int = 8  # decode: reservations one request id may take (leases are not renewable without end)
    # decode: how long a prefill worker's keep-alives (RenewLease) may keep one reservation's lease running
    max_reservation_hold_ms: int = 300_000
    kv_chunk_bytes: int = 8 << 20  # prefill: KV pages per message on a KV channel, in bytes (pipelined)
    kv_channels_per_peer: int = 4  # prefill: lanes (channels) per decode worker, one transfer each at a time
    # Fault injection for the failure tests: the prefill worker sleeps this long between
    # announcing a transfer and posting its send (0: off).
    fault_transfer_stall_s: float = 0.0
    # Fault injection: this token's embedding row becomes NaN, so a prompt holding it gets
    # logits that are not finite (the request must fail, never answer; None: off).
    fault_nan_token: int | None = None

    def __post_init__(self) -> None:
        parse_source(self.gateway, "gateway")  # ValueError naming the flag
        if not self.gateway_refresh_s > 0:
            raise ValueError(f"gateway_refresh_s must be > 0, got {self.gateway_refresh_s}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.kv_channel_timeout_s <= 0:
            raise ValueError(f"kv_channel_timeout_s must be > 0, got {self.kv_channel_timeout_s}")
        if self.kv_channels_per_peer < 1:
            raise ValueError(f"kv_channels_per_peer must be >= 1, got {self.kv_channels_per_peer}")
        if self.kv_chunk_bytes < 1:
            raise ValueError(f"kv_chunk_bytes must be >= 1, got {self.kv_chunk_bytes}")
        if self.max_reservation_hold_ms < 1:
            raise ValueError(f"max_reservation_hold_ms must be >= 1, got {self.max_reservation_hold_ms}")
        if self.max_reservations_per_request < 1:
            raise ValueError(f"max_reservations_per_request must be >= 1, got {self.max_reservations_per_request}")

    def resolved_transport(self) -> str:
        if self.transport != "auto":
            return self.transport
        return "nccl" if self.engine.device.startswith("cuda") else "gloo"


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    model: str
    max_model_len: int | None = None
    local_prefill_max_tokens: int = 32  # prompts shorter than this prefill on the decode worker
    heartbeat_period_ms: int = 500
    heartbeat_miss_count: int = 3
    max_in_flight: int = 256  # more concurrent requests: RESOURCE_EXHAUSTED
    reservation_wait_ms: int = 5_000
    lease_ms: int = 15_000
    # Admission by the prefill pool's queue depth (gateway/admission.py): queued prompt tokens per
    # live prefill worker before remote-prefill requests wait here (0: no gate); how many may
    # wait; how long one may wait. Past either: RESOURCE_EXHAUSTED.
    prefill_queue_max_tokens: int = 4096
    admission_max_waiting: int = 128
    admission_max_wait_ms: int = 120_000
    max_attempts: int = 3  # routing attempts while nothing was streamed
    max_migrations: int = 2  # continuations on another decode worker after tokens were streamed
    max_stop_strings: int = 8
    max_stop_string_bytes: int = 256
    # After a (re)start: NOT_SERVING, and requests wait for a decode worker, until one registered or this passed.
    startup_grace_s: float = 10.0
    internal_port: int = 0  # the worker registry's port (never the public one); 0: ephemeral
    routing: RoutingConfig = RoutingConfig()


    def __post_init__(self) -> None:
        if self.startup_grace_s < 0:
            raise ValueError(f"startup_grace_s must be >= 0, got {self.startup_grace_s}")
        if not 0 <= self.internal_port <= 65535:
            raise ValueError(f"internal_port must be in [0, 65535], got {self.internal_port}")
        if self.internal_port and self.internal_port == self.server.port:
            raise ValueError("internal_port must differ from port: the registry is never on the public port")
        for name in ("heartbeat_period_ms", "heartbeat_miss_count", "max_in_flight",
                     "reservation_wait_ms", "lease_ms", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_queue_max_tokens", "admission_max_waiting", "admission_max_wait_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")


def add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    add_flag(p, "--host", default="127.0.0.1", help="bind address")
    add_flag(p, "--port", type=int, default=default_port, help="gRPC port (0: ephemeral)")
    add_flag(p, "--advertise-host", default=None, help="host peers dial (default: --host)")
    add_flag(p, "--metrics-port", type=int, default=-1, help="Prometheus port (-1 off, 0 ephemeral)")
    add_flag(p, "--ready-file", default=None,
             help="once serving, write a 'surface host:port' line here for each surface that listens "
                  "(public, internal, health, metrics)")
    add_flag(p, "--log-level", default="info", help="debug|info|warning|error")
    add_flag(p, "--health-port", type=int, default=-1,
             help="plaintext grpc.health.v1-only port for kubelet probes (-1 off, 0 ephemeral)")
    add_flag(p, "--drain-grace-s", type=float, default=0.0,
             help="on SIGTERM, report NOT_SERVING but keep serving this long before closing")
    add_flag(p, "--drain-timeout-s", type=float, default=10.0,
             help="then, how long in-flight calls may take to finish")
    add_tls_flags(p)
    add_flag(p, "--tls-reload-check-s", type=float, default=5.0,
             help="check the TLS and token files for a change this often (SIGHUP: at once)")
    add_flag(p, "--internal-secret", default=None,
             help="shared secret required on internal ports and sent by internal clients "
                  "(prefer the variable or --internal-secret-file)")
    add_flag(p, "--internal-secret-file", default=None, help="file holding the internal shared secret")
    add_flag(p, "--insecure-internal", action="store_true",
             help="serve the internal port on a non-loopback --host with no authentication (refused "
                  "without this flag; logs a warning)")


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """The TLS files (services and clients alike)."""
    add_flag(p, "--tls-cert", default=None, help="PEM certificate: TLS on every port and channel")
    add_flag(p, "--tls-key", default=None, help="PEM private key of --tls-cert")
    add_flag(p, "--tls-ca", default=None,
             help="PEM CA bundle: verify peers against it; internal ports then require client certificates")
    add_flag(p, "--tls-server-name", default=None,
             help="name expected in peers' certificates, whatever address is dialed (default: the host)")


def tls_config(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                     server_name=args.tls_server_name, check_s=getattr(args, "tls_reload_check_s", 5.0))


def server_config(args: argparse.Namespace) -> ServerConfig:
    security = SecurityConfig(
        tls=tls_config(args), api_keys=getattr(args, "api_keys", None),
        api_keys_file=getattr(args, "api_keys_file", None),
        internal_secret=args.internal_secret, internal_secret_file=args.internal_secret_file,
        insecure_internal=args.insecure_internal,
    )
    return ServerConfig(
        host=args.host, port=args.port, advertise_host=args.advertise_host,
        metrics_port=args.metrics_port, health_port=args.health_port, ready_file=args.ready_file,
        log_level=args.log_level, drain_grace_s=args.drain_grace_s, drain_timeout_s=args.drain_timeout_s,
        security=security,
    )


def add_engine_flags(p: argparse.ArgumentParser, default_model: str) -> None:
    add_flag(p, "--model", default=default_model, help="local checkpoint directory or .gguf file")
    add_flag(p, "--dtype", default="float32", help="float32|bfloat16|float16")
    add_flag(p, "--quantization", default="none", choices=["none", "int8", "int4"],
             help="weight-only quantization at load: int8 per output channel, int4 in groups")
    add_flag(p, "--quant-group-size", type=int, default=32, help="int4: input features per group (32|64|128)")
    add_flag(p, "--kv-cache-dtype", default="auto", choices=["auto", "int8"],
             help="KV cache element type: auto (= --dtype) or int8 (per token and head scales)")
    add_flag(p, "--device", default="cpu", help="cpu or cuda[:n]")
    add_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(p, "--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (wins over --kv-cache-bytes)")
    add_flag(p, "--kv-cache-bytes", type=byte_size, default=None,
             help=f"KV pool size as memory, e.g. 2GiB (default {DEFAULT_KV_CACHE_BYTES >> 20}MiB; vLLM-CPU's "
             "VLLM_CPU_KVCACHE_SPACE)")
    add_flag(p, "--max-num-seqs", type=int, default=64, help="running batch cap")
    add_flag(p, "--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    add_flag(p, "--max-model-len", type=int, default=None, help="cap on prompt + output")
    add_flag(p, "--threads", type=int, default=1, help="torch threads")
    add_flag(p, "--batch-invariant", action="store_true",
             help="a request's logits the same bits whatever else its steps carry: the panel GEMM at every "
                  "row count (float32, native kernels; no quantization or speculative decoding)")
    add_flag(p, "--speculative", default="none", choices=["none", "ngram", "draft_model", "ngram_draft"],
             help="speculative decoding (decode worker)")
    add_flag(p, "--num-speculative-tokens", type=int, default=4, help="draft tokens per step")
    add_flag(p, "--draft-model", default=None, help="draft checkpoint for --speculative draft_model")
    add_flag(p, "--ngram-min", type=int, default=None,
             help="shortest recurring suffix n-gram lookup drafts from (default: the method's)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    speculative = None
    if args.speculative != "none":
        speculative = SpeculativeConfig(
            method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model, ngram_min=args.ngram_min,
        )
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_threads=args.threads, speculative=speculative, quantization=args.quantization,
        quant_group_size=args.quant_group_size, kv_cache_dtype=args.kv_cache_dtype,
        batch_invariant=args.batch_invariant,
        detokenize=False,  # workers stream token ids; the gateway detokenizes
    )


def add_worker_flags(p: argparse.ArgumentParser, default_model: str) -> None:
    add_server_flags(p, default_port=0)
    add_engine_flags(p, default_model)
    add_flag(p, "--gateway", default="127.0.0.1:50052",
             help="the gateways' internal addresses (their registries); the worker registers with each: "
                  "host:port[,host:port...], dns:///name:port (every A/AAAA record; dns://server:port/name:port "
                  "asks that server), or kubernetes:///service.namespace:port (EndpointSlices)")
    add_flag(p, "--gateway-refresh-s", type=float, default=1.0,
             help="ask --gateway's DNS name or EndpointSlices again this often")
    add_flag(p, "--transport", default="auto", choices=list(TRANSPORTS), help="KV transport")
    add_flag(p, "--kv-channel-timeout-s", deprecated=("--transfer-timeout-s",), type=float, default=30.0,
             help="deadline of one KV channel operation (a message, a join); not of a whole transfer")
    add_flag(p, "--max-reservations-per-request", type=int, default=8,
             help="decode: KV reservations one request id may take on this worker")
    add_flag(p, "--max-reservation-hold-ms", type=int, default=300_000,
             help="decode: the longest a prefill worker's keep-alives may keep one KV reservation's lease running")
    add_flag(p, "--kv-chunk-bytes", type=int, default=8 << 20,
             help="prefill: KV pages travel in messages of about this many bytes, packed while earlier ones are on the wire")
    add_flag(p, "--kv-channels-per-peer", type=int, default=4,
             help="prefill: KV channels to each decode worker; each carries one transfer at a time")
    add_flag(p, "--fault-transfer-stall-s", type=float, default=0.0,
             help="failure testing only: stall each KV send this long after announcing it")
    add_flag(p, "--fault-nan-token", type=int, default=None,
             help="failure testing only: this token id's embedding becomes NaN (its requests must fail)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        server=server_config(args), engine=engine_config(args), gateway=args.gateway,
        gateway_refresh_s=args.gateway_refresh_s,
        transport=args.transport, kv_channel_timeout_s=args.kv_channel_timeout_s,
        max_reservations_per_request=args.max_reservations_per_request,
        max_reservation_hold_ms=args.max_reservation_hold_ms,
        fault_transfer_stall_s=args.fault_transfer_stall_s, fault_nan_token=args.fault_nan_token,
        kv_chunk_bytes=args.kv_chunk_bytes,
        kv_channels_per_peer=args.kv_channels_per_peer,
    )


def add_gateway_flags(p: argparse.ArgumentParser, default_model: str) -> None:
    add_server_flags(p, default_port=50051)
    add_flag(p, "--internal-port", type=int, default=50052,
             help="port of the worker registry (internal: mTLS or the shared secret; 0: ephemeral)")
    add_flag(p, "--api-keys", default=None,
             help="accepted API keys, comma-separated (prefer the variable or --api-keys-file)")
    add_flag(p, "--api-keys-file", default=None, help="file of accepted API keys, one a line")
    add_flag(p, "--model", default=default_model, help="checkpoint directory or .gguf file (tokenizer, limits)")
    add_flag(p, "--max-model-len", type=int, default=None, help="cap on prompt + output")
    add_flag(p, "--local-prefill-max-tokens", type=int, default=32,
             help="prompts (with prefix routing: their part the decode worker does not hold) shorter than "
                  "this prefill on the decode worker; 0: every prompt on a prefill worker while one is alive")
    add_flag(p, "--heartbeat-period-ms", type=int, default=500, help="worker heartbeat period")
    add_flag(p, "--heartbeat-miss-count", type=int, default=3, help="missed beats before a worker is dropped")
    add_flag(p, "--max-in-flight", type=int, default=256, help="concurrent requests before RESOURCE_EXHAUSTED")
    add_flag(p, "--reservation-wait-ms", type=int, default=5000, help="wait for decode KV blocks")
    add_flag(p, "--lease-ms", type=int, default=15000, help="decode reservation lease")
    add_flag(p, "--prefill-queue-max-tokens", type=int, default=4096,
             help="prompt tokens queued per live prefill worker before remote-prefill requests wait at the "
                  "gateway (0: no admission gate)")
    add_flag(p, "--admission-max-waiting", type=int, default=128,
             help="requests waiting for the prefill pool at once; more are refused (RESOURCE_EXHAUSTED)")
    add_flag(p, "--admission-max-wait-ms", type=int, default=120_000,
             help="the longest a request waits for the prefill pool before RESOURCE_EXHAUSTED")
    add_flag(p, "--max-migrations", type=int, default=2,
             help="times a stream whose decode worker failed mid-stream is continued on another (0: never)")
    add_flag(p, "--startup-grace-s", type=float, default=10.0,
             help="after a start, NOT_SERVING until a decode worker registered or this many seconds passed")
    add_routing_flags(p)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        server=server_config(args), model=args.model, max_model_len=args.max_model_len,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        heartbeat_period_ms=args.heartbeat_period_ms, heartbeat_miss_count=args.heartbeat_miss_count,
        max_in_flight=args.max_in_flight, reservation_wait_ms=args.reservation_wait_ms,
        lease_ms=args.lease_ms, prefill_queue_max_tokens=args.prefill_queue_max_tokens,
        admission_max_waiting=args.admission_max_waiting, admission_max_wait_ms=args.admission_max_wait_ms,
        startup_grace_s=args.startup_grace_s, max_migrations=args.max_migrations,
        internal_port=args.internal_port, routing=routing_config(args),
    )
