"""``splitserve up``: a gateway plus N prefill and M decode worker processes on this machine.

Each service is its own process (``python -m splitserve.cli <role> ...``), so a crash or a
``kill -9`` of one behaves as it would in a deployment. SIGINT/SIGTERM to ``up`` sends
SIGTERM to every child (health NOT_SERVING, drain, exit), waits for them, and kills any
that outlive the grace period.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from plumbing.logs import configure_logging

log = structlog.get_logger()


def service_command(role: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", role, *flags]


def wait_ready(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """Wait until a service wrote its address to ``path``; raise if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3]} exited with code {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args[3]} not ready after {timeout_s} s")


class Cluster:
    """Start and stop the processes (also used by the end-to-end tests and the benchmark)."""

    def __init__(self, model: str, port: int = 0, num_prefill: int = 1, num_decode: int = 1,
                 threads: int = 1, gateway_flags: list[str] | None = None,
                 worker_flags: list[str] | None = None, prefill_flags: list[str] | None = None,
                 decode_flags: list[str] | None = None, metrics_port: int = -1,
                 log_dir: str | None = None, log_level: str = "info") -> None:
        self.model = model
        self.port = port
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.threads = threads
        self.gateway_flags = gateway_flags or []
        self.worker_flags = worker_flags or []
        self.prefill_flags = prefill_flags or []
        self.decode_flags = decode_flags or []
        self.metrics_port = metrics_port
        self.log_dir = Path(log_dir) if log_dir else None
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addresses: dict[str, str] = {}
        self._commands: dict[str, tuple[str, list[str]]] = {}  # name -> (role, flags), for restart
        self._tmp = tempfile.TemporaryDirectory(prefix="splitserve-")

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
        return [] if self.metrics_port < 0 else ["--metrics-port", str(self.metrics_port + offset)]

    def start(self, timeout_s: float = 120.0) -> str:
        """Start everything; return the gateway address once every worker registered."""
        gw, ready = self._spawn("gateway", "gateway", [
            "--model", self.model, "--port", str(self.port), *self._metrics(0), *self.gateway_flags])
        self.addresses["gateway"] = wait_ready(ready, gw, timeout_s)
        waiting = []
        common = ["--model", self.model, "--gateway", self.addresses["gateway"],
                  "--threads", str(self.threads), *self.worker_flags]
        for i in range(self.num_prefill):
            waiting.append((f"prefill-{i}", *self._spawn(
                f"prefill-{i}", "prefill", [*common, *self._metrics(1 + i), *self.prefill_flags])))
        for i in range(self.num_decode):
            waiting.append((f"decode-{i}", *self._spawn(
                f"decode-{i}", "decode",
                [*common, *self._metrics(1 + self.num_prefill + i), *self.decode_flags])))
        for name, proc, ready in waiting:
            self.addresses[name] = wait_ready(ready, proc, timeout_s)
        self._wait_registered(timeout_s)
        return self.addresses["gateway"]

    def _wait_registered(self, timeout_s: float) -> None:
        from splitserve.client import wait_for_workers

        wait_for_workers(self.addresses["gateway"], self.num_prefill, self.num_decode, timeout_s)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one service and wait for it to exit; its exit code."""
        proc = self.procs[name]
        proc.send_signal(sig)
        return proc.wait()

    def restart(self, name: str, timeout_s: float = 120.0) -> str:
        """Start an exited service again on the address it had (a new process: a new
        incarnation at the same host:port); return that address once it is ready."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        role, flags = self._commands[name]
        port = self.addresses[name].rsplit(":", 1)[1]
        proc, ready = self._spawn(name, role, [*flags, "--port", port])  # the last --port wins
        self.addresses[name] = wait_ready(ready, proc, timeout_s)
        return self.addresses[name]

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every child (workers first), wait, SIGKILL stragglers; return exit codes."""
        order = [n for n in self.procs if n != "gateway"] + (["gateway"] if "gateway" in self.procs else [])
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


def run_cluster(args: argparse.Namespace) -> int:
    configure_logging("up", args.log_level)
    extra = [a for a in args.service_args if a != "--"]
    cluster = Cluster(
        model=args.model, port=args.port, num_prefill=args.num_prefill, num_decode=args.num_decode,
        threads=args.threads, worker_flags=extra, metrics_port=args.metrics_port,
        gateway_flags=["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)],
        log_dir=args.log_dir, log_level=args.log_level,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        address = cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        log.error("up.failed", error=str(exc))
        cluster.stop(grace_s=5)
        return 1
    log.info("up.ready", gateway=address, num_prefill=args.num_prefill, num_decode=args.num_decode,
             hint=f"splitserve generate --gateway {address} 'def fibonacci(n):'")
    while not stopping:
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            log.error("up.child_exited", services=dead)
            break
        time.sleep(0.2)
    codes = cluster.stop()
    log.info("up.stopped", exit_codes=codes)
    return 0 if all(c == 0 for c in codes.values()) and stopping else 1
