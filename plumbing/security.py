"""One process's security, built once from its ``SecurityConfig``: the TLS material, the
public API keys, the internal shared secret, and their reload.

Surfaces (``plumbing/servers.py`` applies them):

========  =====================================  ==========================================
surface   who calls it                           authenticated by
========  =====================================  ==========================================
public    clients (the gateway's ``Gateway``)    TLS (server certificate) + API keys
internal  the services (registry, worker RPCs)   mTLS when ``--tls-ca`` is given, and/or the
                                                 shared secret (``--internal-secret*``)
health    kubelet probes (``--health-port``)     nothing: plaintext, grpc.health.v1 only
========  =====================================  ==========================================

``watch`` reloads the files (TLS and token files) when they change, and at once on SIGHUP.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import structlog

from plumbing.auth import TokenSet
from plumbing.channels import ChannelSecurity
from plumbing.config import SecurityConfig, is_loopback
from plumbing.tls import TlsStore

log = structlog.get_logger()


def _optional_tokens(name: str, file: str | None, inline: str | None) -> TokenSet | None:
    return TokenSet(name, file=file, inline=inline) if file is not None or inline else None


@dataclass
class Security:
    config: SecurityConfig
    tls: TlsStore | None
    api_keys: TokenSet | None
    internal_secret: TokenSet | None

    @classmethod
    def from_config(cls, config: SecurityConfig) -> Security:
        """Load every file now: a missing or broken one is a ValueError naming its flag."""
        return cls(
            config=config,
            tls=TlsStore(config.tls) if config.tls.enabled or config.tls.ca_file else None,
            api_keys=_optional_tokens("api_keys", config.api_keys_file, config.api_keys),
            internal_secret=_optional_tokens("internal_secret", config.internal_secret_file,
                                             config.internal_secret),
        )

    @property
    def serves_tls(self) -> bool:
        return self.tls is not None and self.config.tls.enabled

    @property
    def mutual_tls(self) -> bool:
        return self.serves_tls and self.config.tls.mutual

    def channels(self) -> ChannelSecurity:
        """How this process dials its internal peers."""
        return ChannelSecurity(self.tls, self.internal_secret)

    def describe(self) -> dict[str, object]:
        """For the startup log line (never a secret)."""
        return {"tls": self.serves_tls, "mtls": self.mutual_tls,
                "api_keys": self.api_keys is not None, "internal_secret": self.internal_secret is not None}

    def warn_if_open(self, host: str) -> None:
        """A non-loopback internal port without authentication starts only with
        ``--insecure-internal`` (``ServerConfig`` refuses it otherwise); it is logged."""
        if not is_loopback(host) and not self.mutual_tls and self.internal_secret is None:
            log.warning("security.internal_unauthenticated", host=host, insecure_internal=self.config.insecure_internal,
                        hint="internal ports accept anyone who can reach them: give --tls-ca (mTLS) "
                             "or --internal-secret-file, or keep them on a private network")

    def reload(self, force: bool = False) -> None:
        if self.tls is not None:
            self.tls.reload(force)
        for tokens in (self.api_keys, self.internal_secret):
            if tokens is not None:
                tokens.reload(force)

    async def watch(self) -> None:
        """Reload on SIGHUP at once, and whenever a file changed (checked every
        ``tls_reload_check_s``); runs until cancelled."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: self._on_sighup())
        try:
            while True:
                await asyncio.sleep(self.config.tls.check_s)
                self.reload()
        finally:  # a SIGHUP while starting or stopping reloads nothing, and never kills the process
            loop.remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_sighup(self) -> None:
        log.info("security.sighup")
        self.reload(force=True)
