"""``splitserve http``'s flags and their frozen, validated config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from plumbing import config as cfg
from plumbing.resume import ResumePolicy, gateway_target
from plumbing.tls import TlsConfig


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

    @property
    def resume(self) -> ResumePolicy:
        return ResumePolicy(max_retries=self.max_resumes)


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
    cfg.add_flag(p, "--ready-file", default=None, help="write the bound host:port here once listening")
    cfg.add_flag(p, "--log-level", default="info", help="debug|info|warning|error")


def http_config(args: argparse.Namespace) -> HttpConfig:
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                        server_name=args.tls_server_name)
    return HttpConfig(gateway=args.gateway, host=args.host, port=args.http_port, timeout_s=args.timeout_s,
                      default_max_tokens=args.default_max_tokens, token=args.token, tls=tls,
                      ready_file=args.ready_file, max_resumes=args.max_resumes)
