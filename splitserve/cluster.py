"""``splitserve up``: gateways plus N prefill and M decode worker processes on this machine.

``--num-gateways G`` runs G gateway replicas (docs/architecture.md, "Gateway replicas"): every
worker registers with each of them (``--gateway`` a static list of their internal addresses,
or any discovery source). ``up`` mints an internal shared secret for the run: every internal
port asks for it, every service sends it (a process without it cannot register as a worker).

Each service is its own process (``python -m splitserve.cli <role> ...``), so a crash or a
``kill -9`` of one behaves as it would in a deployment. SIGINT/SIGTERM to ``up`` sends
SIGTERM to every child (health NOT_SERVING, drain, exit), waits for them, and kills any
that outlive the grace period; SIGHUP is passed on (the services reload their TLS and key
files).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from plumbing.discovery import join_host_port
from plumbing.logs import configure_logging
from plumbing.servers import read_ready_file
from plumbing.tls import TlsConfig
from splitserve.certs import Bundle, write_bundle
from splitserve.client import ClientAuth
from splitserve.progress import ProgressWatch, write_status

log = structlog.get_logger()


def free_ports(hosts: list[str], avoid: int) -> list[int]:
    """A port free now on each host, none of them ``avoid`` and no two alike (the kernel's picks,
    held together while picking; another process could still take one before it is bound)."""
    held: list[socket.socket] = []
    try:
        while len(held) < len(hosts):
            host = hosts[len(held)]
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            held.append(s)
            if s.getsockname()[1] == avoid or s.getsockname()[1] in [h.getsockname()[1] for h in held[:-1]]:
                held.pop().close()
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def service_command(role: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", role, *flags]


def wait_ready(path: Path, proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> dict[str, str]:
    """Wait until a service wrote its ready file at ``path``, for as long as it makes progress
    (splitserve/progress.py) and, where ``timeout_s`` is given, no longer; raise if it exits
    first. Its addresses by surface (``public``, ``internal``, ``health``, ``metrics``)."""
    watch = ProgressWatch({proc.args[3]: proc})
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return read_ready_file(path.read_text())
        watch.check()
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args[3]} not ready after {timeout_s} s")


class Cluster:
    """Start and stop the processes (also used by the end-to-end tests and the benchmark)."""

    def __init__(self, model: str, port: int = 0, num_prefill: int = 1, num_decode: int = 1,
                 threads: int = 1, gateway_flags: list[str] | None = None,
                 worker_flags: list[str] | None = None, prefill_flags: list[str] | None = None,
                 decode_flags: list[str] | None = None, metrics_port: int = -1,
                 log_dir: str | None = None, log_level: str = "info", tls: Bundle | None = None,
                 api_keys: list[str] | None = None, http_port: int | None = None,
                 http_flags: list[str] | None = None, http_gateways: list[str] | None = None,
                 num_gateways: int = 1,
                 gateway_hosts: list[str] | None = None, gateway_internal_port: int = 0,
                 gateway_discovery: str | None = None, internal_secret: str | None = None,
                 early_workers: bool = False) -> None:
        self.model = model
        self.port = port
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.threads = threads
        self.gateway_flags = gateway_flags or []
        self.worker_flags = worker_flags or []
        self.prefill_flags = prefill_flags or []
        self.decode_flags = decode_flags or []
        # /metrics: -1 none; 0 every service on a free port of its own; N: the first gateway on N,
        # then the workers (prefill, then decode) on N + 1, ...; where each listens: metrics_addresses.
        self.metrics_port = metrics_port
        self.metrics_addresses: dict[str, str] = {}
        self.log_dir = Path(log_dir) if log_dir else None
        self.log_level = log_level
        self.http_port = http_port  # None: no HTTP front; 0: a free port (addresses["http"])
        self.http_flags = http_flags or []
        self.http_gateways = http_gateways or []  # other deployments' gateways the front also calls
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addresses: dict[str, str] = {}
        self._commands: dict[str, tuple[str, list[str]]] = {}  # name -> (role, flags), for restart
        self._tmp = tempfile.TemporaryDirectory(prefix="splitserve-")
        # Gateway replicas: "gateway", "gateway-1", ...; each binds its host (default 127.0.0.1)
        # and gateway_internal_port (0: each a free one; one port for all when DNS names them).
        self.gateway_names = ["gateway", *(f"gateway-{i}" for i in range(1, num_gateways))]
        self.gateway_hosts = gateway_hosts or ["127.0.0.1"] * num_gateways
        if len(self.gateway_hosts) != num_gateways or num_gateways < 1:
            raise ValueError(f"gateway_hosts: one host per gateway ({num_gateways}), got {self.gateway_hosts}")
        self.gateway_internal_port = gateway_internal_port
        self.gateway_discovery = gateway_discovery  # the workers' --gateway; None: the static list
        # Spawn the workers beside the gateways, not once they listen: each gateway gets a free
        # internal port picked here, so the workers know it before it binds (``up``'s cold start).
        self.early_workers = early_workers
        self.internal_secret = internal_secret  # every internal port asks for it; None: open (loopback)
        # TLS on every port and channel (mTLS inside) with one throwaway set (splitserve/certs.py),
        # API keys on the public port; ``client`` is what a client of this cluster needs.
        self.tls = tls
        self.api_keys = api_keys or []
        self.client = ClientAuth(
            tls=TlsConfig(cert_file=str(tls.cert), key_file=str(tls.key), ca_file=str(tls.ca)) if tls else None,
            token=self.api_keys[0] if self.api_keys else None)

    def _security_flags(self) -> list[str]:
        """Flags every service gets: the TLS set, the internal secret's file, and no health port
        (an inherited ``SPLITSERVE_HEALTH_PORT`` would make them all bind the same one)."""
        flags = [*(self.tls.flags() if self.tls else []), "--health-port", "-1"]
        if self.internal_secret is not None:
            secret = Path(self._tmp.name) / "internal-secret"
            if not secret.exists():
                secret.touch(mode=0o600)
                secret.write_text(self.internal_secret + "\n")
            flags += ["--internal-secret-file", str(secret)]
        return flags

    def _gateway_flags(self, index: int, internal_port: int | None = None) -> list[str]:
        port = self.port if index == 0 else 0
        internal = self.gateway_internal_port if internal_port is None else internal_port
        flags = ["--model", self.model, "--host", self.gateway_hosts[index], "--port", str(port),
                 "--internal-port", str(internal), *self._metrics(0 if index == 0 else -1)]
        if self.api_keys:
            keys = Path(self._tmp.name) / "api-keys"
            keys.write_text("\n".join(self.api_keys) + "\n")
            flags += ["--api-keys-file", str(keys)]
        return [*flags, *self._security_flags(), *self.gateway_flags]

    def _ready(self, name: str, proc: subprocess.Popen[bytes], ready: Path, timeout_s: float | None) -> str:
        """Wait for ``name``'s ready file; record its address (the gateway's internal one too)
        and its /metrics one. A service that exits first: the error carries its log's end."""
        try:
            surfaces = wait_ready(ready, proc, timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its log ends:\n{self._log_tail(name)}") from exc
        self.addresses[name] = surfaces["public"]
        if name in self.gateway_names:
            self.addresses[f"{name}-internal"] = surfaces["internal"]
        if "metrics" in surfaces:
            self.metrics_addresses[name] = surfaces["metrics"]
        return surfaces["public"]

    def _log_tail(self, name: str, lines: int = 20) -> str:
        if self.log_dir is None:
            return "(no log_dir: its output went to this process's own)"
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(unreadable: {exc})"

    @property
    def gateway_addresses(self) -> list[str]:
        """Every gateway replica's public address (those started so far)."""
        return [self.addresses[n] for n in self.gateway_names if n in self.addresses]

    def _spawn(self, name: str, role: str, flags: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        ready = Path(self._tmp.name) / f"{name}.addr"
        ready.unlink(missing_ok=True)
        self._commands[name] = (role, flags)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = service_command(role, [*flags, "--ready-file", str(ready), "--log-level", self.log_level])
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        self.procs[name] = proc
        return proc, ready

    def _metrics(self, offset: int) -> list[str]:
        """The metrics port ``offset`` after ``metrics_port``; a free one for offset -1 or
        ``metrics_port`` 0."""
        if self.metrics_port < 0:
            return []
        return ["--metrics-port", str(self.metrics_port + offset if offset >= 0 and self.metrics_port else 0)]

    def start(self, timeout_s: float | None = None) -> str:
        """Start everything; return the gateway address once every worker registered with every
        gateway. Waits while the services make progress (not a fixed time: a busy machine loads
        slowly), and no longer than ``timeout_s`` where given."""
        early = self.early_workers and self.gateway_discovery is None and not self.gateway_internal_port
        internal = free_ports(self.gateway_hosts, self.port) if early else [None] * len(self.gateway_hosts)
        gateways = [(n, *self._spawn(n, "gateway", self._gateway_flags(i, internal[i])))
                    for i, n in enumerate(self.gateway_names)]
        waiting = []
        if early:  # the workers load their model while the gateways start; they register once those listen
            waiting = self._spawn_workers(",".join(join_host_port(h, p) for h, p in zip(self.gateway_hosts, internal)))
        for name, proc, ready in gateways:
            self._ready(name, proc, ready, timeout_s)
        if not early:
            waiting = self._spawn_workers(
                self.gateway_discovery or ",".join(self.addresses[f"{n}-internal"] for n in self.gateway_names))
        for name, proc, ready in waiting:
            self._ready(name, proc, ready, timeout_s)
        self._wait_registered(timeout_s)
        if self.http_port is not None:
            self._start_http(timeout_s)
        return self.addresses["gateway"]

    def _spawn_workers(self, discovery: str) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        """Every prefill and decode worker, told to find the gateways at ``discovery``."""
        common = ["--model", self.model, "--gateway", discovery,
                  "--threads", str(self.threads), *self._security_flags(), *self.worker_flags]
        waiting = []
        for i in range(self.num_prefill):
            waiting.append((f"prefill-{i}", *self._spawn(
                f"prefill-{i}", "prefill", [*common, *self._metrics(1 + i), *self.prefill_flags])))
        for i in range(self.num_decode):
            waiting.append((f"decode-{i}", *self._spawn(
                f"decode-{i}", "decode",
                [*common, *self._metrics(1 + self.num_prefill + i), *self.decode_flags])))
        return waiting

    def _start_http(self, timeout_s: float | None) -> None:
        """The OpenAI-compatible front (``splitserve http``), a client of every gateway replica."""
        gateways = [*self.http_gateways, *self.gateway_addresses]
        flags = ["--gateway", ",".join(gateways), "--http-port", str(self.http_port)]
        if self.tls:
            flags += ["--tls-ca", str(self.tls.ca), "--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        proc, ready = self._spawn("http", "http", [*flags, *self.http_flags])
        self._ready("http", proc, ready, timeout_s)

    def _wait_registered(self, timeout_s: float | None) -> None:
        from splitserve.client import wait_for_workers

        watch = ProgressWatch(dict(self.procs))
        for address in self.gateway_addresses:  # every replica: each worker registered with each
            wait_for_workers(address, self.num_prefill, self.num_decode, timeout_s, self.client, watch=watch.check)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one service and wait for it to exit; its exit code."""
        proc = self.procs[name]
        proc.send_signal(sig)
        return proc.wait()

    def restart(self, name: str, timeout_s: float | None = None) -> str:
        """Start an exited service again on the address it had (a new process: a new
        incarnation at the same host:port); return that address once it is ready."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        proc, ready = self._spawn(name, *self.restart_command(name))
        return self._ready(name, proc, ready, timeout_s)

    def restart_command(self, name: str) -> tuple[str, list[str]]:
        """``name``'s role and flags again, pinned to the ports it had (the last flag wins)."""
        role, flags = self._commands[name]
        again = [*flags, "--port", self.addresses[name].rsplit(":", 1)[1]]
        if name in self.gateway_names:
            again += ["--internal-port", self.addresses[f"{name}-internal"].rsplit(":", 1)[1]]
        return role, again

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every child (workers first), wait, SIGKILL stragglers; return exit codes."""
        first = [n for n in ("http",) if n in self.procs]  # the front before the services it calls
        order = first + [n for n in self.procs if n not in (*self.gateway_names, "http")] + [
            n for n in self.gateway_names if n in self.procs]
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for name in order:
            proc = self.procs[name]
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self._tmp.cleanup()
        return codes

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop(grace_s=5)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mint_secret() -> str:
    """A fresh internal shared secret (256 bits), for one run of ``up``."""
    return secrets.token_urlsafe(32)


def run_cluster(args: argparse.Namespace) -> int:
    configure_logging("up", args.log_level)
    extra = [a for a in args.service_args if a != "--"]
    tls_dir = tempfile.TemporaryDirectory(prefix="splitserve-tls-") if args.tls and not args.log_dir else None
    bundle = None
    if args.tls:  # a throwaway CA and one certificate for every service (splitserve/certs.py)
        bundle = write_bundle(Path(tls_dir.name) if tls_dir else Path(args.log_dir) / "tls")
    cluster = Cluster(
        model=args.model, port=args.port, num_prefill=args.num_prefill, num_decode=args.num_decode,
        threads=args.threads, worker_flags=extra, metrics_port=args.metrics_port,
        gateway_flags=["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)],
        log_dir=args.log_dir, log_level=args.log_level, tls=bundle,
        http_port=args.http_port if args.http_port >= 0 else None, num_gateways=args.num_gateways,
        internal_secret=mint_secret(),  # secure by default: no process without it registers as a worker
        early_workers=True,  # cold start: the workers load while the gateway starts
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def reload(signum: int, frame: object) -> None:  # SIGHUP: every service re-reads its TLS and key files
        for proc in cluster.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, reload)
    write_status(args.status_file, "starting")
    try:
        address = cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        log.error("up.failed", error=str(exc))
        write_status(args.status_file, "failed", error=str(exc))
        cluster.stop(grace_s=5)
        return 1
    write_status(args.status_file, "ready", gateway=address)
    tls_flag = f" --tls-ca {bundle.ca}" if bundle else ""
    log.info("up.ready", gateway=address, gateways=cluster.gateway_addresses,
             gateways_internal=[cluster.addresses[f"{n}-internal"] for n in cluster.gateway_names],
             http=cluster.addresses.get("http"), metrics=cluster.metrics_addresses or None,
             num_prefill=args.num_prefill, num_decode=args.num_decode,
             tls_ca=str(bundle.ca) if bundle else None,
             hint=f"splitserve generate --gateway {address}{tls_flag} 'def fibonacci(n):'")
    while not stopping:
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            log.error("up.child_exited", services=dead)
            break
        time.sleep(0.2)
    codes = cluster.stop()
    if tls_dir is not None:
        tls_dir.cleanup()
    write_status(args.status_file, "stopped")
    log.info("up.stopped", exit_codes=codes)
    return 0 if all(c == 0 for c in codes.values()) and stopping else 1
