"""Start and stop of single service processes (issue #10, item 6).

* A prefill worker whose KV channel is still opening (its decode peer never answers the
  handshake) exits on SIGTERM within its grace. Before, the blocked handshake thread held
  the process until the transfer timeout, past the grace, and it was SIGKILLed.
* A (re)started gateway reports NOT_SERVING until a decode worker registered.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.cluster import wait_ready
from splitserve_api.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kv_transfer_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.e2e.cluster_util import MODEL

pytestmark = [pytest.mark.slow]


class SilentDecodeWorker(decode_pb2_grpc.DecodeWorkerServicer):
    """Takes the handshake and never answers it (a peer that hangs)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def OpenKVChannel(self, request: kv_transfer_pb2.KVChannelHandshake, context: grpc.ServicerContext
                      ) -> kv_transfer_pb2.KVChannelAccept:
        self.entered.set()
        self.release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "test peer gone")


def _service(role: str, flags: list[str], ready: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "splitserve.cli", role, *flags, "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_prefill_worker_with_a_channel_still_opening_exits_within_its_grace(tmp_path: Path) -> None:
    silent = SilentDecodeWorker()
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(silent, fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    proc = _service("prefill", ["--model", MODEL, "--gateway", "127.0.0.1:1", "--threads", "1",
                                "--kv-channel-timeout-s", "600", "--drain-timeout-s", "1"], tmp_path / "ready")
    try:
        address = wait_ready(tmp_path / "ready", proc, 120)["public"]
        target = prefill_pb2.DecodeTarget(worker_id=1, address=f"127.0.0.1:{port}", transfer_id=5, num_blocks=3,
                                          incarnation=7, transfer_secret=bytes(range(16)))
        request = prefill_pb2.PrefillRequest(request_id=9, prompt_token_ids=list(range(5, 45)),
                                             stopping=common_pb2.StoppingCriteria(max_new_tokens=4), target=target)
        outcome: dict[str, object] = {}

        def prefill() -> None:
            with grpc.insecure_channel(address) as channel:
                try:
                    prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=120)
                except grpc.RpcError as exc:
                    outcome["code"] = exc.code()

        caller = threading.Thread(target=prefill)
        caller.start()
        assert silent.entered.wait(60), "the prefill worker never opened the channel"
        proc.terminate()
        try:
            code = proc.wait(timeout=60)  # the grace is 1 s; the handshake would block 600 s
        except subprocess.TimeoutExpired:
            pytest.fail("the prefill worker did not exit on SIGTERM while a channel was opening")
        assert code == 0
        caller.join(30)
        assert outcome.get("code") in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        silent.release.set()
        if proc.poll() is None:
            proc.kill()
        fake.stop(None)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_started_gateway_is_not_serving_until_a_decode_worker_registered(tmp_path: Path) -> None:
    proc = _service("gateway", ["--model", MODEL, "--port", "0", "--internal-port", "0", "--startup-grace-s", "600"],
                    tmp_path / "ready")
    try:
        ready = wait_ready(tmp_path / "ready", proc, 120)
        address, internal = ready["public"], ready["internal"]
        assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(internal) as channel:  # the registry is on the internal port
            registry = gateway_pb2_grpc.WorkerRegistryStub(channel)
            load = common_pb2.WorkerLoad(kv_blocks_total=4, kv_blocks_free=4)
            registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:1", model="target", load=load,
                incarnation=1), timeout=5)
            assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING  # a prefill worker is not enough
            registry.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:2", model="target", load=load,
                incarnation=2), timeout=5)
        deadline = time.monotonic() + 30
        while _health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "still NOT_SERVING after a decode worker registered"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
