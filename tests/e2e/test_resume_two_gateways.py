"""A stream continues on *another* gateway (issue #21): two independent deployments on
127.0.0.1, each a gateway with its own decode worker (which prefills locally), so nothing of
a request's state is shared but what the client sends back. One ``GatewayClient`` and the
HTTP front go round-robin over both gateways; gateway A is killed (-9) mid-stream and stays
dead. Every stream completes on B with every token and the text once, equal to the
undisturbed runs (greedy: the in-process engine); the streams A held were resumed on B; no
block is held afterwards on either side.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from plumbing.rpc import channel_options
from splitserve.client import GatewayClient, make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2, decode_pb2_grpc
from tests.e2e.cluster_util import MODEL, idle, wait_all_free
from tests.e2e.test_resume import (MAX_TOKENS, PATIENT, PROMPTS, Received, _openai_stream, drain, references,  # noqa: F401
                                   wait_progress)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_resume_two")]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    logs = tmp_path_factory.mktemp("logs-resume-two")
    flags = {"num_prefill": 0, "num_decode": 1, "gateway_flags": ["--startup-grace-s", "30"]}
    with Cluster(MODEL, log_dir=str(logs / "a"), **flags) as a:  # type: ignore[arg-type]
        # B's front goes round-robin over A's gateway and B's own.
        with Cluster(MODEL, log_dir=str(logs / "b"), http_port=0, http_gateways=[a.addresses["gateway"]],  # type: ignore[arg-type]
                     http_flags=["--max-resumes", "200"], **flags) as b:
            yield a, b


def test_streams_continue_on_the_other_gateway(clusters: tuple[Cluster, Cluster], references: list[list[int]]) -> None:
    a, b = clusters
    http = openai.OpenAI(base_url=f"http://{b.addresses['http']}/v1", api_key="unused", max_retries=0)
    prompts = ["def fibonacci(n):", "class BlockPool:\n    def free(self"]
    requests = [make_request(p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    with GatewayClient([a.addresses["gateway"], b.addresses["gateway"]], policy=PATIENT) as client, \
            cf.ThreadPoolExecutor(len(requests) + len(prompts)) as pool:
        undisturbed_text = list(pool.map(lambda p: _openai_stream(http, p), prompts))
        drain(client, make_request(PROMPTS[0], 2), Received())
        time.sleep(0.5)  # both gateways' connections up: round-robin alternates between them
        grpc_out = [Received() for _ in requests]
        http_seen: list[list[str]] = [[] for _ in prompts]
        futures = [pool.submit(drain, client, r, out) for r, out in zip(requests, grpc_out)]
        futures += [pool.submit(_openai_stream, http, p, seen) for p, seen in zip(prompts, http_seen)]
        counts = [lambda o=o: len(o.token_ids) for o in grpc_out] + [lambda s=s: len(s) for s in http_seen]
        wait_progress(counts, [3] * len(counts))
        a.kill("gateway")
        results = [f.result(timeout=300) for f in futures]
    for i, (got, want) in enumerate(zip(results[: len(requests)], references)):
        assert got.final is not None and got.final.finish_reason == common_pb2.FINISH_REASON_LENGTH, i
        assert got.token_ids == want, f"request {i}: a token missing, repeated or wrong"
    assert any(r.final.timings.resumes == 1 for r in results[: len(requests)]), "no stream was on gateway A"
    assert results[len(requests):] == undisturbed_text
    stats = wait_all_free(b.addresses["gateway"], within_s=10.0)
    assert stats and all(idle(s) for s in stats.values()), stats
    # A's decode worker lost its gateway: the streams it ran were cancelled and freed their blocks.
    deadline = time.monotonic() + 10
    while not idle(load := _decode_stats(a)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(load), load


def _decode_stats(cluster: Cluster) -> common_pb2.WorkerLoad:
    with grpc.insecure_channel(cluster.addresses["decode-0"], options=channel_options()) as channel:
        return decode_pb2_grpc.DecodeWorkerStub(channel).GetStats(common_pb2.GetStatsRequest(), timeout=10)
