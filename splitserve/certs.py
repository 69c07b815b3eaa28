"""Throwaway certificates: a private CA and the leaf certificates it signs.

``splitserve up --tls`` makes one set for a local try-out, and the tests and the TLS benchmark
make theirs the same way. Keys are EC P-256, written unencrypted: fine for a try-out on one
machine, never for a deployment (use your own CA, cert-manager or the mesh's; see
``deploy/kubernetes/README.md``).

One leaf serves every service of the local cluster: it is valid for TLS servers and clients
(both extended key usages), for the names and IP addresses given.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """Write ``stem.pem`` and ``stem.key`` (mode 0600) under ``directory``."""
        cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
        cert_path.write_bytes(self.cert_pem)
        key_path.touch(mode=0o600)
        key_path.write_bytes(self.key_pem)
        return cert_path, key_path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "splitserve throwaway CA", valid_days: float = 30.0) -> Issued:
    """A self-signed CA certificate that may sign leaves (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _san(hosts: list[str] | tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(ca: Issued, common_name: str, hosts: list[str] | tuple[str, ...] = LOCAL_HOSTS,
          valid_days: float = 30.0, not_before: dt.datetime | None = None,
          not_after: dt.datetime | None = None) -> Issued:
    """A leaf signed by ``ca`` for ``hosts`` (DNS names or IP addresses), valid for TLS
    servers and clients. ``not_before``/``not_after`` override the validity (an expired
    certificate for the tests)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    end = not_after or start + dt.timedelta(days=valid_days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                       critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass(frozen=True)
class Bundle:
    """Files of a throwaway set: the CA certificate and one leaf (certificate and key)."""

    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        """The services' TLS flags for this set."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def write_bundle(directory: Path, hosts: list[str] | tuple[str, ...] = LOCAL_HOSTS,
                 ca: Issued | None = None) -> Bundle:
    """Make (or use) a CA and a leaf for ``hosts``; write ``ca.pem``, ``tls.pem``, ``tls.key``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = ca or make_ca()
    (directory / "ca.pem").write_bytes(ca.cert_pem)
    cert, key = issue(ca, "splitserve", hosts).write(directory, "tls")
    return Bundle(directory / "ca.pem", cert, key)
