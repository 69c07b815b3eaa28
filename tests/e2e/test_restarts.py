"""Restarts on the same addresses (issue #10, items 1, 2, 3, 5 and 6) with real processes:
a gateway, 2 prefill and 2 decode workers on 127.0.0.1, every prompt prefilled remotely.

* Items 1 and 2: a decode worker and a prefill worker are killed (-9) and restarted on the
  same addresses; then a stream of requests runs. Before the fix the surviving prefill
  worker kept its channel to the dead decode incarnation (every remote prefill failed with
  "channel_id N is not open here" and fell back), and with channel ids counted from 1 a stale
  channel's transfers landed in another request's blocks: OK replies continuing another
  user's prompt. Here every reply equals the in-process engine's, every one was prefilled
  remotely, and no leg failed.
* Item 3: the gateway is killed and restarted on its port; every worker registers again.
* Item 5: undecodable bytes get INVALID_ARGUMENT from every real service.
* Item 6: after all of it, every line the services wrote is a JSON log line.
"""

from __future__ import annotations

import json
import random

import grpc
import pytest

from splitserve.client import make_request, wait_for_workers
from splitserve.cluster import Cluster
from splitserve_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.cluster_util import MODEL, idle, stream_many, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_restarts")]

NUM_REQUESTS = 16
MAX_TOKENS = 12


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(rng.randrange(20, 90))] for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def references() -> dict[int, list[list[int]]]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {seed: [o.token_ids for o in engine.generate(_prompts(seed), params)] for seed in (1, 2, 3)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-restarts")
    with Cluster(MODEL, num_prefill=2, num_decode=2, log_dir=str(logs),
                 gateway_flags=["--local-prefill-max-tokens", "0", "--startup-grace-s", "30"],
                 worker_flags=["--kv-channel-timeout-s", "10"]) as c:
        yield c


def _run(cluster: Cluster, seed: int, references: dict[int, list[list[int]]]) -> list[int]:
    """Stream the seed's requests at once; check every reply; return their request ids."""
    requests = [make_request(p, MAX_TOKENS, ignore_eos=True) for p in _prompts(seed)]
    results = stream_many(cluster.addresses["gateway"], requests, timeout=120)
    for i, (res, want) in enumerate(zip(results, references[seed])):
        assert res.error is None, (i, res.error, res.details)
        assert res.token_ids == want, f"request {i}: another request's KV? {res.token_ids} != {want}"
        assert res.timings.transfer_bytes > 0, f"request {i} was not prefilled remotely"
    return [r.request_id for r in results]


def _leg_failures(cluster: Cluster) -> int:
    return (cluster.log_dir / "gateway.log").read_text().count("request.leg_failed")


def _worker_ids(cluster: Cluster) -> dict[str, int]:
    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
    return {w.address: w.worker_id for w in info.workers}


def _wait_reregistered(cluster: Cluster, names: list[str], before: dict[str, int], timeout_s: float = 60) -> None:
    """Until every named worker is listed under a new id (its new incarnation registered)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _worker_ids(cluster)
        if all(now.get(cluster.addresses[n], before.get(cluster.addresses[n])) != before.get(cluster.addresses[n])
               for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"{names} did not register again within {timeout_s} s")


def test_undecodable_bytes_get_invalid_argument_from_every_service(cluster: Cluster) -> None:
    noise = bytes(random.Random(5).randrange(256) for _ in range(40))
    cases = [("gateway", "/splitserve.v1.Gateway/GenerateUnary", b"\x0a\x02\xff\xfe"),  # prompt.text: bad UTF-8
             ("gateway-internal", "/splitserve.v1.WorkerRegistry/Heartbeat", b"\x0a\x05ab")]  # truncated
    for name, service, method in (("decode-0", "DecodeWorker", "GetStats"), ("decode-0", "DecodeWorker", "Decode"),
                                  ("prefill-0", "PrefillWorker", "Prefill")):
        cases += [(name, f"/splitserve.v1.{service}/{method}", payload) for payload in (b"\x00\x01", noise)]
    for name, method, payload in cases:
        with grpc.insecure_channel(cluster.addresses[name]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                if method.endswith("/Decode"):
                    list(channel.unary_stream(method)(payload, timeout=10))
                else:
                    channel.unary_unary(method)(payload, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, method, payload, info.value.details())


def test_requests_before_any_restart(cluster: Cluster, references: dict[int, list[list[int]]]) -> None:
    ids = _run(cluster, 1, references)  # opens channels between the pairs
    assert len(set(ids)) == len(ids) and max(ids) > 1 << 32
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))  # minted, not counted


def test_restarted_decode_and_prefill_workers_on_the_same_addresses(
    cluster: Cluster, references: dict[int, list[list[int]]],
) -> None:
    before = _worker_ids(cluster)
    failures = _leg_failures(cluster)
    for name in ("decode-0", "prefill-0"):
        cluster.kill(name)
        cluster.restart(name)
    _wait_reregistered(cluster, ["decode-0", "prefill-0"], before)
    # The gateway drops the dead entries as the new incarnations register at their addresses.
    wait_for_workers(cluster.addresses["gateway"], 2, 2, timeout_s=30)
    _run(cluster, 2, references)
    _run(cluster, 3, references)
    assert _leg_failures(cluster) == failures  # no FAILED_PRECONDITION, no local fallback, no retry
    stats = wait_all_free(cluster.addresses["gateway"], within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats


def test_every_worker_registers_again_with_a_restarted_gateway(
    cluster: Cluster, references: dict[int, list[list[int]]],
) -> None:
    cluster.kill("gateway")
    cluster.restart("gateway")
    wait_for_workers(cluster.addresses["gateway"], 2, 2, timeout_s=30)
    _run(cluster, 1, references)


def test_every_line_the_services_wrote_is_json(cluster: Cluster) -> None:
    for path in sorted(cluster.log_dir.glob("*.log")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError:
                    pytest.fail(f"{path.name}:{number} is not a JSON log line: {line[:300]}")
