"""Streams that outlive their gateway (issue #21), with real processes on 127.0.0.1: a gateway,
a prefill and a decode worker, and the HTTP front. The gateway is killed (-9) mid-stream and
restarted on its ports (the workers register again); the streams of ``GatewayClient`` and of
the official ``openai`` client through the front go on from the tokens already delivered.

Required: no failed request, every token once (the whole stream equals the undisturbed one:
greedy equals the in-process engine, seeded equals the same request run undisturbed, the text
too), each stream actually resumed, and every KV block free afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai
import pytest

from engine.models.spec import load_tokenizer
from splitserve.client import GatewayClient, make_request, wait_for_workers
from splitserve.cluster import Cluster
from plumbing.resume import ResumePolicy
from splitserve_api.v1 import common_pb2, gateway_pb2
from tests.e2e.cluster_util import MODEL, code_prompts, idle, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_resume")]

MAX_TOKENS = 400  # long enough that every stream is cut mid-way
PATIENT = ResumePolicy(max_retries=100, first_backoff_s=0.05, max_backoff_s=0.5)  # rides out a restart
PROMPTS = code_prompts(load_tokenizer(MODEL), [23, 41, 30, 52])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-resume")
    with Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(logs), http_port=0,
                 gateway_flags=["--local-prefill-max-tokens", "0", "--startup-grace-s", "30"],
                 http_flags=["--max-resumes", "200"]) as c:
        yield c


@pytest.fixture(scope="module")
def references() -> list[list[int]]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


@dataclass
class Received:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: gateway_pb2.GenerateResponse | None = None


def receive(address: str, request: gateway_pb2.GenerateRequest, out: Received | None = None) -> Received:
    """One request through its own ``GatewayClient`` to its final chunk, into ``out``."""
    with GatewayClient(address, policy=PATIENT) as client:
        return drain(client, request, out if out is not None else Received())


def drain(client: GatewayClient, request: gateway_pb2.GenerateRequest, out: Received) -> Received:
    """``client.generate(request)`` into ``out`` as it comes."""
    for chunk in client.generate(request, timeout_s=240):
        assert out.final is None, "a chunk after the final one"
        out.token_ids += chunk.token_ids
        out.text += chunk.text
        if chunk.finish_reason:
            out.final = chunk
    return out


def wait_progress(counts: list[Callable[[], int]], at_least: list[int], timeout_s: float = 120) -> None:
    """Until every stream's count reached its bound."""
    deadline = time.monotonic() + timeout_s
    while any(c() < n for c, n in zip(counts, at_least)):
        assert time.monotonic() < deadline, "a stream made no progress"
        time.sleep(0.005)


def kill_and_restart_gateway(cluster: Cluster, counts: list[Callable[[], int]], times: int = 1) -> None:
    """Kill (-9) and restart the gateway ``times`` times, each once every stream received a
    few tokens more than at the kill before."""
    reached = [0] * len(counts)
    for _ in range(times):
        wait_progress(counts, [n + 3 for n in reached])
        cluster.kill("gateway")
        reached = [c() for c in counts]
        cluster.restart("gateway")


def assert_no_leaks(cluster: Cluster) -> None:
    wait_for_workers(cluster.addresses["gateway"], 1, 1, timeout_s=60)
    stats = wait_all_free(cluster.addresses["gateway"], within_s=10.0)
    assert len(stats) == 2 and all(idle(s) for s in stats.values()), stats


def test_python_client_streams_outlive_a_killed_gateway(cluster: Cluster, references: list[list[int]]) -> None:
    address = cluster.addresses["gateway"]
    seeded = make_request(PROMPTS[0], MAX_TOKENS, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
    requests = [make_request(p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS] + [seeded]
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        undisturbed = list(pool.map(lambda r: receive(address, r), requests))
    assert [u.token_ids for u in undisturbed[:-1]] == references
    results = [Received() for _ in requests]
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(receive, address, r, out) for r, out in zip(requests, results)]
        kill_and_restart_gateway(cluster, [lambda out=out: len(out.token_ids) for out in results], times=2)
        for f in futures:
            f.result(timeout=300)
    for i, (got, want) in enumerate(zip(results, undisturbed)):
        assert got.final is not None and got.final.finish_reason == common_pb2.FINISH_REASON_LENGTH, i
        assert got.token_ids == want.token_ids, f"request {i}: a token missing, repeated or wrong"
        assert got.text == want.text, f"request {i}: the text differs from the undisturbed stream's"
        assert got.final.timings.resumes == 2, f"request {i} was not cut by both kills: the test proved less"
        assert got.final.num_prompt_tokens == len(requests[i].token_ids.ids)
    assert_no_leaks(cluster)


def _openai_stream(client: openai.OpenAI, prompt: str, received: list[str] | None = None) -> tuple[str, int]:
    stream = client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    text, num_tokens, finish = "", 0, None
    for event in stream:
        if event.choices:
            text += event.choices[0].text
            finish = event.choices[0].finish_reason or finish
            if received is not None:
                received.append(event.choices[0].text)
        if event.usage is not None:
            num_tokens = event.usage.completion_tokens
    assert finish == "length"
    return text, num_tokens


def test_openai_streams_through_the_front_outlive_a_killed_gateway(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="unused", max_retries=0)
    prompts = ["def fibonacci(n):", "class BlockPool:\n    def free(self", "import numpy as np\n\n"]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        undisturbed = list(pool.map(lambda p: _openai_stream(client, p), prompts))
    assert all(n == MAX_TOKENS for _, n in undisturbed)
    received: list[list[str]] = [[] for _ in prompts]
    resumed_before = _front_resumed(cluster)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_openai_stream, client, p, r) for p, r in zip(prompts, received)]
        kill_and_restart_gateway(cluster, [lambda r=r: len(r) for r in received])
        results = [f.result(timeout=300) for f in futures]
    assert results == undisturbed  # the text once, no gap; every token counted once
    assert len(_front_resumed(cluster) - resumed_before) == len(prompts)  # each was cut mid-stream
    assert_no_leaks(cluster)


def _front_resumed(cluster: Cluster) -> set[str]:
    """Request ids of the streams the front resumed with tokens delivered (its
    ``client.resuming`` log lines)."""
    ids = set()
    for line in (cluster.log_dir / "http.log").read_text().splitlines():  # type: ignore[operator]
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "client.resuming" and record.get("num_delivered", 0) > 0:
            ids.add(record.get("request_id"))
    return ids
