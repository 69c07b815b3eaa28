"""A real DNS server for the discovery tests: Debian's dnsmasq (``make tools`` installs it) on
127.0.0.1 and a free port, answering for ``*.splitserve.test`` from a hosts file that the
test rewrites (``set``: the file, then SIGHUP; dnsmasq re-reads it). Names it does not list
get NXDOMAIN (the domain is local: nothing is forwarded anywhere)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from plumbing.discovery import DiscoveryError, DnsSource

DOMAIN = "splitserve.test"


def dnsmasq_or_skip() -> str:
    path = shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq",) if Path(p).exists()), None)
    if path is None:
        pytest.skip("dnsmasq is not installed (make tools installs it): no DNS server to discover through")
    return path


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shared_port(hosts: list[str]) -> int:
    """A TCP port free on every one of ``hosts`` (the gateways behind one name share it, as
    pods behind a headless Service do)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on every one of {hosts}")


class DnsServer:
    def __init__(self, records: dict[str, list[str]]) -> None:
        self._binary = dnsmasq_or_skip()
        self._dir = tempfile.TemporaryDirectory(prefix="splitserve-dns-")
        self.hosts = Path(self._dir.name) / "hosts"
        self.records = dict(records)
        self._write()
        self.port = _free_udp_port()
        self.proc = subprocess.Popen([
            self._binary, "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}",
            f"--local=/{DOMAIN}/", "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={self.port}",
            "--pid-file=", "--user=root", "--local-ttl=0", "--log-facility=/dev/null",
        ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_answering()

    def _write(self) -> None:
        lines = [f"{ip} {name}" for name, ips in self.records.items() for ip in ips]
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts)

    def spec(self, name: str, port: int) -> str:
        """The ``--gateway`` value naming ``name`` on this server."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def resolve(self, name: str, port: int) -> list[str]:
        return asyncio.run(DnsSource(name, port, ("127.0.0.1", self.port), timeout_s=1.0).resolve())

    def set(self, name: str, ips: list[str]) -> None:
        """``name`` answers ``ips`` from now on (every A record; none: NXDOMAIN)."""
        self.records[name] = ips
        self._write()
        self.proc.send_signal(signal.SIGHUP)
        want = sorted(f"{ip}:1" for ip in ips)
        self._until(lambda: self.resolve(name, 1) == want, f"{name} -> {ips}")

    def _wait_answering(self) -> None:
        self._until(lambda: self.resolve(f"absent.{DOMAIN}", 1) == [], "dnsmasq answers")

    def _until(self, check, what: str, timeout_s: float = 15.0) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}")
            try:
                if check():
                    return
            except DiscoveryError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"dnsmasq: not within {timeout_s} s: {what}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> DnsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
