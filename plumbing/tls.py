"""TLS for every gRPC server and client channel: the files, their reload, the credentials.

``--tls-cert``/``--tls-key`` give a service its certificate: its servers speak TLS with it and
its client channels present it. ``--tls-ca`` is the trust anchor: clients verify servers
against it, and a service's internal servers require a client certificate signed by it
(mTLS between the gateway and the workers and between workers). Without ``--tls-cert``
everything stays plaintext (the local default).

Rotation without dropping a stream: ``TlsStore`` holds the current material and a
generation number. ``reload`` re-reads the files when they changed (``check_s`` polling, or
at once on SIGHUP; a Kubernetes Secret volume swaps its files atomically), checks that key
and certificate belong together, and keeps the old material when the new files are
incomplete or broken. Servers use gRPC's dynamic credentials: the new certificate applies
to every TLS handshake after the reload, while established connections (and the streams on
them) keep theirs. Client channels are rebuilt for new calls (``plumbing/channels.py``).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = structlog.get_logger()


@dataclass(frozen=True)
class TlsConfig:
    """Where the certificate, its key and the CA bundle are (PEM files)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    # The name client channels expect in their peers' certificates, whatever address they
    # dial (one certificate for every pod of a role); default: the host dialed.
    server_name: str | None = None
    check_s: float = 5.0  # how often the files are checked for a change (SIGHUP: at once)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.check_s <= 0:
            raise ValueError(f"tls_reload_check_s must be > 0, got {self.check_s}")

    @property
    def enabled(self) -> bool:
        """This process has a certificate: its servers speak TLS."""
        return self.cert_file is not None

    @property
    def mutual(self) -> bool:
        """Internal servers require client certificates signed by the CA."""
        return self.enabled and self.ca_file is not None


@dataclass(frozen=True)
class TlsMaterial:
    """One consistent read of the files."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    not_after: dt.datetime | None  # the certificate's expiry


def _read(path: str, what: str) -> bytes:
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - one read
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what}: {path} is not PEM")
    return data


def load_material(config: TlsConfig) -> TlsMaterial:
    """Read the files; ValueError naming the flag when one is missing, not PEM, or when the
    key does not belong to the certificate."""
    cert = _read(config.cert_file, "tls_cert") if config.cert_file else None
    key = _read(config.key_file, "tls_key") if config.key_file else None
    ca = _read(config.ca_file, "tls_ca") if config.ca_file else None
    not_after = None
    if cert is not None and key is not None:
        try:
            leaf = x509.load_pem_x509_certificate(cert)
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"tls_cert/tls_key: cannot load: {exc}") from None
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        if (leaf.public_key().public_bytes(serialization.Encoding.DER, spki)
                != private.public_key().public_bytes(serialization.Encoding.DER, spki)):
            raise ValueError("tls_key does not belong to tls_cert")
        not_after = leaf.not_valid_after_utc
    if ca is not None:
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise ValueError(f"tls_ca: cannot load {config.ca_file}: {exc}") from None
    return TlsMaterial(cert, key, ca, not_after)


def _stamp(paths: list[str | None]) -> tuple[Any, ...]:
    """What changes when a file is replaced (symlinks followed: Secret volumes swap them)."""
    stamp: list[Any] = []
    for path in paths:
        if path is None:
            continue
        try:
            st = os.stat(path)
            stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            stamp.append(None)
    return tuple(stamp)


class TlsStore:
    """The current TLS material and its generation (bumped by each successful reload).

    Any thread may read ``material``/``generation`` (plain attribute reads); ``reload`` runs
    on the event loop.
    """

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self.material = load_material(config)
        self.generation = 0
        self._stamp = _stamp(self._paths())

    def _paths(self) -> list[str | None]:
        return [self.config.cert_file, self.config.key_file, self.config.ca_file]

    def reload(self, force: bool = False) -> bool:
        """Re-read the files if they changed (or ``force``); True when new material is in use."""
        stamp = _stamp(self._paths())
        if not force and stamp == self._stamp:
            return False
        try:
            material = load_material(self.config)
        except ValueError as exc:
            log.warning("tls.reload_failed", error=str(exc), keeping="the previous certificate")
            return False  # the stamp is kept: a later check retries
        self._stamp = stamp
        if material == self.material:
            return False
        self.material = material
        self.generation += 1
        log.info("tls.reloaded", generation=self.generation,
                 not_after=material.not_after.isoformat() if material.not_after else None)
        return True

    # -- servers ------------------------------------------------------------------------
    def _server_config(self, client_auth: bool) -> grpc.ServerCertificateConfiguration:
        m = self.material
        assert m.cert is not None and m.key is not None
        return grpc.ssl_server_certificate_configuration(
            [(m.key, m.cert)], root_certificates=m.ca if client_auth else None)

    def server_credentials(self, client_auth: bool) -> grpc.ServerCredentials:
        """Credentials for one listening port; ``client_auth``: require a client certificate
        signed by the CA (mTLS). Each new connection gets the material current then."""
        if client_auth and self.material.ca is None:
            raise ValueError("tls_ca is needed to require client certificates")
        served = [self.generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC's thread, per handshake
            generation = self.generation
            if generation == served[0]:
                return None
            served[0] = generation
            return self._server_config(client_auth)

        return grpc.dynamic_ssl_server_credentials(
            self._server_config(client_auth), fetch, require_client_authentication=client_auth)

    # -- clients ------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify servers against the CA (the system's roots without one); present this
        process's certificate when it has one."""
        m = self.material
        return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        name = self.config.server_name
        return [("grpc.ssl_target_name_override", name)] if name else []

