"""``splitserve http``'s flags and their frozen, validated config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from plumbing import config as cfg
from plumbing.resume import ResumePolicy, gateway_target
from plumbing.rpc import MAX_MESSAGE_BYTES
from plumbing.tls import TlsConfig

# What a GenerateRequest may carry beyond the bytes of the JSON body it came from (fields the
# body left to defaults; a prompt, token ids, messages and stop strings take fewer bytes in
# protobuf than in JSON): the gRPC channel's send limit is --max-body-bytes plus this.
SEND_HEADROOM_BYTES = 64 << 10
# The default cap: a body that fits is a request the gateway accepts (its 4 MiB receive limit).
DEFAULT_MAX_BODY_BYTES = MAX_MESSAGE_BYTES - SEND_HEADROOM_BYTES
_MAX_CHANNEL_BYTES = 2**31 - 1  # gRPC's size options are C ints


@dataclass(frozen=True)
class HttpConfig:
    gateway: str = "127.0.0.1:50051"  # the gateway's public gRPC address(es): plumbing/resume.py's gateway_target
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (written to ready_file)
    timeout_s: float = 600.0  # deadline of every gateway call
    default_max_tokens: int = 256  # chat requests without max_tokens / max_completion_tokens
    token: str | None = None  # API key for the gateway when the client sends none
    tls: TlsConfig | None = None  # TLS toward the gateway (verify with tls.ca_file)
    ready_file: str | None = None
    max_resumes: int = 20  # re-sends of a stream whose gateway died (plumbing/resume.py)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413, counted while read

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.gateway or ":" not in self.gateway:
            raise ValueError(f"gateway must be host:port, got {self.gateway!r}")
        gateway_target(self.gateway)  # ValueError naming the address
        ResumePolicy(max_retries=self.max_resumes)  # ValueError for max_resumes < 0
        if not 1024 <= self.max_body_bytes <= _MAX_CHANNEL_BYTES - SEND_HEADROOM_BYTES:
            raise ValueError(f"max_body_bytes must be in [1024, {_MAX_CHANNEL_BYTES - SEND_HEADROOM_BYTES}], "
                             f"got {self.max_body_bytes}")

    @property
    def resume(self) -> ResumePolicy:
        return ResumePolicy(max_retries=self.max_resumes)

    @property
    def max_send_bytes(self) -> int:
        """The gRPC channel's send limit: room for any request a body within the cap makes, so
        a too-large body is the front's 413 and never the channel's RESOURCE_EXHAUSTED."""
        return self.max_body_bytes + SEND_HEADROOM_BYTES


def add_http_flags(p: argparse.ArgumentParser) -> None:
    cfg.add_flag(p, "--gateway", default="127.0.0.1:50051",
                 help="the gateway's public gRPC address; several: comma-separated IP:port, or one DNS name "
                      "resolving to every gateway (calls go round-robin; a broken stream resumes on another)")
    cfg.add_flag(p, "--max-resumes", type=int, default=20,
                 help="re-sends of a stream whose gateway died, with back-off, within --timeout-s (0: none)")
    cfg.add_flag(p, "--host", default="127.0.0.1", help="HTTP listen address")
    cfg.add_flag(p, "--http-port", type=int, default=8000, help="HTTP port (0: a free one)")
    cfg.add_flag(p, "--timeout-s", type=float, default=600.0, help="deadline of each gateway call")
    cfg.add_flag(p, "--default-max-tokens", type=int, default=256,
                 help="max_tokens of a chat request that names none")
    cfg.add_flag(p, "--token", default=None,
                 help="API key for the gateway when a client sends no Authorization (prefer the variable)")
    cfg.add_tls_flags(p)
    cfg.add_flag(p, "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                 help="larger request bodies are refused with 413 (the gateway takes 4 MiB messages)")
    cfg.add_flag(p, "--ready-file", default=None, help="write the bound host:port here once listening")
    cfg.add_flag(p, "--log-level", default="info", help="debug|info|warning|error")


def http_config(args: argparse.Namespace) -> HttpConfig:
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                        server_name=args.tls_server_name)
    return HttpConfig(gateway=args.gateway, host=args.host, port=args.http_port, timeout_s=args.timeout_s,
                      default_max_tokens=args.default_max_tokens, token=args.token, tls=tls,
                      ready_file=args.ready_file, max_resumes=args.max_resumes, max_body_bytes=args.max_body_bytes)
