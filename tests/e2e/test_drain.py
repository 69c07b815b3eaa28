"""A drain as Kubernetes sees it: SIGTERM to a real gateway process while a stream is running
and Watch streams are open, checked the way a kubelet gRPC probe checks (a fresh connection
per check) until the process has exited.

The decode worker is a stand-in in this process that streams one token every 100 ms, so
the request in flight outlives the drain grace: it must finish, not be cut.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.identity import mint_id
from splitserve.client import make_request
from splitserve.cluster import wait_ready
from splitserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.e2e.cluster_util import MODEL

pytestmark = [pytest.mark.slow]

GRACE_S, TIMEOUT_S, TOKEN_GAP_S = 3.0, 20.0, 0.1
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class SlowDecodeWorker(decode_pb2_grpc.DecodeWorkerServicer):
    """Streams ``max_new_tokens`` tokens, one every ``TOKEN_GAP_S`` (local prefill only)."""

    def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext):  # noqa: ANN201
        for _ in range(request.stopping.max_new_tokens):
            time.sleep(TOKEN_GAP_S)
            yield decode_pb2.DecodeResponse(tokens=decode_pb2.TokenChunk(token_ids=[65]))
        yield decode_pb2.DecodeResponse(finished=decode_pb2.DecodeFinished(
            finish_reason=common_pb2.FINISH_REASON_LENGTH))


def _register(registry: str, address: str, stop: threading.Event) -> None:
    """Register the stand-in and heartbeat until ``stop``."""
    load = common_pb2.WorkerLoad(kv_blocks_total=64, kv_blocks_free=64)
    incarnation = mint_id()
    with grpc.insecure_channel(registry) as channel:
        stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
        worker_id = stub.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
            role=common_pb2.WORKER_ROLE_DECODE, address=address, model=Path(MODEL).name, load=load,
            incarnation=incarnation), timeout=10).worker_id
        while not stop.wait(0.1):
            try:
                stub.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=worker_id, load=load, incarnation=incarnation,
                                                            state=common_pb2.WORKER_STATE_SERVING), timeout=1)
            except grpc.RpcError:
                pass  # the gateway is going away


def _probe(address: str, service: str = "") -> str:
    """One kubelet-style check: a fresh connection, one Check, the status or the error."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=1)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return exc.code().name


def _stream(address: str, max_tokens: int, out: dict, started: threading.Event | None = None) -> None:
    tokens, finish = 0, 0
    try:
        with grpc.insecure_channel(address) as channel:
            for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(make_request([5, 6, 7], max_tokens), timeout=60):
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if started is not None:
                    started.set()
        out.update(tokens=tokens, finish=finish)
    except grpc.RpcError as exc:
        out.update(error=exc.code().name, tokens=tokens)


def _watch(address: str, out: dict) -> None:
    with grpc.insecure_channel(address) as channel:
        statuses = []
        try:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                statuses.append(reply.status)
            out.update(statuses=statuses, code="OK", ended=time.monotonic())
        except grpc.RpcError as exc:
            out.update(statuses=statuses, code=exc.code().name, ended=time.monotonic())


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _logged(path: Path, event: str) -> bool:
    return f'"event": "{event}"' in path.read_text()


def _probe_until_exit(proc: subprocess.Popen[bytes], log_path: Path, public: str, health: str,
                      signalled: float) -> list[tuple[str, str, bool]]:
    """Kubelet-style checks every 100 ms until the process exits: (port, answer, whether the
    drain had started before the check)."""
    probes: list[tuple[str, str, bool]] = []
    while proc.poll() is None and time.monotonic() - signalled < GRACE_S + TIMEOUT_S + 10:
        draining = _logged(log_path, "drain.grace")
        probes += [("health", _probe(health), draining), ("public", _probe(public), draining),
                   ("liveness", _probe(health, "liveness"), draining)]
        time.sleep(0.1)
    return probes


def _when_draining(log_path: Path, proc: subprocess.Popen[bytes], public: str, out: dict) -> None:
    """Once the gateway logged the start of its grace, send a short request."""
    while not _logged(log_path, "drain.grace") and proc.poll() is None:
        time.sleep(0.01)
    _stream(public, 5, out)


def test_a_kubelet_sees_not_serving_through_the_grace_and_the_stream_finishes(tmp_path: Path) -> None:
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(SlowDecodeWorker(), fake)
    fake_address = f"127.0.0.1:{fake.add_insecure_port('127.0.0.1:0')}"
    fake.start()
    log_path = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "gateway", "--model", MODEL, "--port", "0", "--internal-port", "0",
         "--health-port", "0", "--drain-grace-s", str(GRACE_S), "--drain-timeout-s", str(TIMEOUT_S),
         "--local-prefill-max-tokens", "1000", "--heartbeat-period-ms", "200", "--ready-file", str(tmp_path / "ready")],
        stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))  # noqa: SIM115 - owned by the child
    stop_beats = threading.Event()
    try:
        ready = wait_ready(tmp_path / "ready", proc, 120)
        public, internal, health = ready["public"], ready["internal"], ready["health"]
        threading.Thread(target=_register, args=(internal, fake_address, stop_beats), daemon=True).start()
        deadline = time.monotonic() + 30
        while _probe(health) != "SERVING":
            assert time.monotonic() < deadline, "the gateway never became SERVING"
            time.sleep(0.05)
        watches = {name: {} for name in ("public", "health")}
        for name, address in (("public", public), ("health", health)):
            threading.Thread(target=_watch, args=(address, watches[name]), daemon=True).start()
        long, started = {}, threading.Event()
        streaming = threading.Thread(target=_stream, args=(public, 40, long, started))
        streaming.start()  # 40 tokens, 100 ms apart: runs past the grace
        assert started.wait(30)
        time.sleep(0.2)  # the Watch streams are open
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        during_grace: dict = {}
        late = threading.Thread(target=_when_draining, args=(log_path, proc, public, during_grace), daemon=True)
        late.start()  # a load balancer that has not noticed yet sends one more request
        probes = _probe_until_exit(proc, log_path, public, health, signalled)
        code = proc.wait(timeout=5)
        exited = time.monotonic() - signalled
        streaming.join(30)
        late.join(30)
    finally:
        stop_beats.set()
        if proc.poll() is None:
            proc.kill()
        fake.stop(None)
    assert code == 0
    assert exited < GRACE_S + TIMEOUT_S  # the open Watch streams did not hold it for the drain timeout
    after_drain_began = [(port, answer) for port, answer, draining in probes if draining]
    assert ("health", "SERVING") not in after_drain_began and ("public", "SERVING") not in after_drain_began
    assert sum(answer == "NOT_SERVING" for port, answer in after_drain_began if port == "health") >= 3
    assert ("public", "NOT_SERVING") in after_drain_began  # connections were still accepted while draining
    liveness = {answer for port, answer in after_drain_began if port == "liveness"}
    assert "SERVING" in liveness and "NOT_SERVING" not in liveness  # a draining process is alive
    assert long == {"tokens": 40, "finish": common_pb2.FINISH_REASON_LENGTH}  # the stream in flight finished
    assert during_grace.get("tokens") == 5 and "error" not in during_grace
    for name, watch in watches.items():
        assert watch["code"] == "OK" and watch["statuses"][-1] == NOT_SERVING, name
        assert watch["statuses"][0] == SERVING, name
    lines = log_path.read_text().splitlines()
    assert [line for line in lines if not _is_json(line)] == [], "\n".join(lines[-30:])  # no traceback at exit
    assert json.loads(lines[-1])["event"] == "gateway.stopped"
