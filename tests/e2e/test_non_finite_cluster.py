"""Logits that are not finite, through real processes: the request fails with a status that
names the cause (never tokens marked complete), the workers keep serving, no block leaks.

Both workers poison one token's embedding (``--fault-nan-token``): a prompt holding it gets NaN
logits wherever it is prefilled, on the prefill worker (a long prompt) or on the decode worker
itself (a short one)."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from splitserve.client import make_request
from splitserve.cluster import Cluster
from tests.e2e.cluster_util import MODEL, idle, stream, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_non_finite")]

POISON = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-non-finite")
    fault = ["--fault-nan-token", str(POISON)]
    with Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(logs), gateway_flags=["--local-prefill-max-tokens", "16"],
                 prefill_flags=fault, decode_flags=fault, http_port=0) as c:
        yield c


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].token_ids


@pytest.mark.parametrize("where", ["prefill worker", "decode worker"])
def test_a_request_with_non_finite_logits_fails_and_the_cluster_serves_on(cluster: Cluster, where: str) -> None:
    gw = cluster.addresses["gateway"]
    n = 40 if where == "prefill worker" else 8  # --local-prefill-max-tokens 16
    bad = list(range(200, 200 + n)) + [POISON, 300]
    res = stream(gw, make_request(bad, 8), 60)
    assert res.error == grpc.StatusCode.DATA_LOSS and res.token_ids == [], (res.error, res.details)
    assert "not all finite" in res.details
    clean = list(range(400, 400 + n))
    ok = stream(gw, make_request(clean, 8), 60)
    assert ok.error is None and ok.token_ids == reference(clean, 8)
    stats = wait_all_free(gw, within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats
    log = (cluster.log_dir / ("prefill-0.log" if where == "prefill worker" else "decode-0.log")).read_text()
    assert "engine.request_failed" in log


def test_the_http_front_answers_500_naming_the_cause(cluster: Cluster) -> None:
    host, port = cluster.addresses["http"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    body = {"model": model, "prompt": list(range(500, 540)) + [POISON], "max_tokens": 4, "temperature": 0.0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    error = json.loads(resp.read())["error"]
    assert resp.status == 500 and "not all finite" in error["message"] and error["code"] == "data_loss", error


MID_PROMPT = list(range(3000, 3024))


@pytest.fixture(scope="module")
def mid_stream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cluster, list[int], int]:
    """A colocated cluster whose poisoned token is one the clean model generates for
    ``MID_PROMPT``: the request streams tokens, then fails at the step that feeds it back."""
    want = reference(MID_PROMPT, 24)
    i = next(i for i in range(2, len(want)) if want[i] not in MID_PROMPT and want[i] not in want[:i])
    logs = tmp_path_factory.mktemp("logs-non-finite-mid")
    with Cluster(MODEL, num_prefill=0, num_decode=1, log_dir=str(logs), http_port=0,
                 decode_flags=["--fault-nan-token", str(want[i])]) as c:
        yield c, want, i


def test_a_failure_mid_stream_ends_it_with_data_loss_after_the_good_tokens(mid_stream) -> None:  # noqa: ANN001
    cluster, want, i = mid_stream
    gw = cluster.addresses["gateway"]
    res = stream(gw, make_request(MID_PROMPT, 24), 60)
    # The poisoned token itself came from finite logits; the step that reads it back fails.
    assert res.token_ids == want[: i + 1] and res.finish_reason == 0
    assert res.error == grpc.StatusCode.DATA_LOSS and f"output token {i + 2}" in res.details, res.details
    assert all(idle(s) for s in wait_all_free(gw, within_s=5.0).values())

    # Through the HTTP front, streamed: the good tokens' chunks, then an error event, and no
    # chunk claiming a finish.
    host, port = cluster.addresses["http"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    body = {"model": model, "prompt": MID_PROMPT, "max_tokens": 24, "temperature": 0.0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
              if line.startswith("data: {")]
    chunks, last = events[:-1], events[-1]
    assert last["error"]["code"] == "data_loss" and "not all finite" in last["error"]["message"], last
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
