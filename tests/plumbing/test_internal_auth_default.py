"""Secure by default on the internal plane: a service whose internal port would listen on a
non-loopback address with no authentication refuses to start (exit 2, naming
``--insecure-internal``) unless given that flag, which logs a warning; ``splitserve up`` with
no flags mints an internal secret, so a process without it cannot register as a worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from plumbing.config import SecurityConfig, ServerConfig
from plumbing.tls import TlsConfig
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "target")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    return dict(env, PYTHONPATH=str(ROOT), GRPC_VERBOSITY="ERROR")


def test_server_config_refuses_an_open_internal_port_off_loopback() -> None:
    for host in ("0.0.0.0", "10.1.2.3", "::", "gateway"):
        with pytest.raises(ValueError, match="--insecure-internal") as info:
            ServerConfig(host=host)
        assert f"host {host} is not a loopback address" in str(info.value)
    for host in ("127.0.0.1", "127.0.0.3", "::1", "localhost"):
        ServerConfig(host=host)
    ServerConfig(host="0.0.0.0", security=SecurityConfig(internal_secret="s"))
    ServerConfig(host="0.0.0.0", security=SecurityConfig(internal_secret_file="/run/secrets/internal"))
    ServerConfig(host="0.0.0.0", security=SecurityConfig(insecure_internal=True))
    mtls = TlsConfig(cert_file="c.pem", key_file="k.pem", ca_file="ca.pem")
    ServerConfig(host="0.0.0.0", security=SecurityConfig(tls=mtls))
    with pytest.raises(ValueError, match="--insecure-internal"):  # TLS without client certificates: still open
        ServerConfig(host="0.0.0.0", security=SecurityConfig(tls=TlsConfig(cert_file="c.pem", key_file="k.pem")))


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_each_service_refuses_to_start_naming_the_flag(role: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", role, "--model", MODEL, "--host", "0.0.0.0"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--insecure-internal" in proc.stderr and "0.0.0.0" in proc.stderr


def test_insecure_internal_starts_and_logs_a_warning(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "gateway", "--model", MODEL, "--host", "0.0.0.0",
                             "--port", "0", "--internal-port", "0", "--insecure-internal", "--ready-file", str(ready)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the gateway did not start with --insecure-internal"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    warnings = [json.loads(line) for line in out.splitlines() if '"security.internal_unauthenticated"' in line]
    assert warnings and warnings[0]["level"] == "warning" and warnings[0]["insecure_internal"] is True


def _ready_line(proc: subprocess.Popen[str], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"up exited with {proc.wait()} before it was ready")
        if '"up.ready"' in line:
            return json.loads(line)
    raise AssertionError("up not ready in time")


def test_up_with_no_flags_refuses_a_fake_worker_on_its_internal_port(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--model", MODEL, "--port", "0",
                             "--num-prefill", "0", "--num-decode", "1", "--log-dir", str(tmp_path)],
                            env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        ready = _ready_line(proc, 300)  # the real decode worker registered (up waits for it)
        (internal,) = ready["gateways_internal"]
        fake = gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1", model="target", incarnation=7,
            kv_layout=common_pb2.KVLayout(block_size=16), load=common_pb2.WorkerLoad(kv_blocks_total=8, kv_blocks_free=8))
        with grpc.insecure_channel(internal) as channel:
            with pytest.raises(grpc.RpcError) as info:
                gateway_pb2_grpc.WorkerRegistryStub(channel).RegisterWorker(fake, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(ready["gateway"]) as channel:
            workers = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=10).workers
        assert [w.address for w in workers] != [] and all(w.address != "127.0.0.1:1" for w in workers)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
