"""End to end through real processes: gateway + 1 prefill + 1 decode worker on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine import Engine, EngineConfig, SamplingParams
from splitserve.client import make_chat_request, make_request
from splitserve.cluster import Cluster
from plumbing.rpc import channel_options
from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, kv_transfer_pb2
from tests.e2e.cluster_util import (
    MODEL, code_prompts, greedy_requests, idle, stream, stream_many, wait_all_free, worker_stats,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_1x1")]

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 40, 47, 48, 49, 63, 64, 65, 80, 96, 100, 127, 128, 129,
           150, 160, 175, 192, 200, 223, 240, 256, 280, 300]
MAX_TOKENS = [8 + (7 * i) % 41 for i in range(len(LENGTHS))]


def free_port() -> int:  # the README's commands name a port (test_up_and_generate_commands_from_the_readme)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    # Each metrics endpoint binds a port of its own choosing (0); the cluster reads it back.
    with Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(tmp_path_factory.mktemp("logs-1x1")),
                 # Spill off: these tests say which prompts go remote by their length alone.
                 gateway_flags=["--local-prefill-max-tokens", "32", "--local-prefill-spill-tokens", "0",
                                "--metrics-port", "0"],
                 decode_flags=["--metrics-port", "0"]) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the in-process Engine's greedy outputs for them."""
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    prompts = code_prompts(engine.tokenizer, LENGTHS)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS])
    return prompts, [o.token_ids for o in outs]


def test_health_serving_and_reflection_on_every_server(cluster: Cluster) -> None:
    expected = {
        "gateway": {"splitserve.v1.Gateway"},
        "gateway-internal": {"splitserve.v1.WorkerRegistry"},
        "prefill-0": {"splitserve.v1.PrefillWorker"},
        "decode-0": {"splitserve.v1.DecodeWorker"},
    }
    for name, services in expected.items():
        with grpc.insecure_channel(cluster.addresses[name]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            listed = {s.name for r in responses for s in r.list_services_response.service}
            assert services | {"grpc.health.v1.Health"} <= listed, name


def test_32_concurrent_greedy_requests_match_the_in_process_engine(cluster: Cluster, reference) -> None:  # noqa: ANN001
    prompts, expected = reference
    results = stream_many(cluster.addresses["gateway"], greedy_requests(prompts, MAX_TOKENS))
    for i, (res, want) in enumerate(zip(results, expected)):
        assert res.error is None, (i, res.error, res.details)
        assert res.token_ids == want, f"request {i} (prompt {LENGTHS[i]} tokens) diverged"
        assert res.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert res.timings.total_us >= res.timings.first_token_us > 0
        if LENGTHS[i] >= 32:  # remote prefill: pages were shipped
            assert res.timings.transfer_bytes > 0
        else:
            assert res.timings.transfer_bytes == 0
    stats = wait_all_free(cluster.addresses["gateway"])
    assert all(idle(s) for s in stats.values()), stats


def test_streamed_text_is_the_incremental_detokenization(cluster: Cluster) -> None:
    res = stream(cluster.addresses["gateway"], make_request("def parse(self, text):\n", 40))
    assert res.error is None and res.chunks >= 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    prompt = tok.encode("def parse(self, text):\n")
    full = tok.decode(prompt + res.token_ids, skip_special_tokens=True)
    assert res.text == full[len(tok.decode(prompt, skip_special_tokens=True)):]


def test_stop_string_ends_the_request_and_frees_both_workers(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    free_run = stream(gw, make_request("class Parser:\n    def __init__(self", 60, ignore_eos=True))
    assert free_run.error is None and len(free_run.text) > 10
    stop = free_run.text[5:8]
    res = stream(gw, make_request("class Parser:\n    def __init__(self", 60, stop=[stop], ignore_eos=True))
    assert res.finish_reason == common_pb2.FINISH_REASON_STOP
    assert res.text == free_run.text[: free_run.text.index(stop)]
    assert all(idle(s) for s in wait_all_free(gw).values())


BAD_REQUESTS = [
    ("empty prompt", make_request("", 8), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("token out of vocabulary", make_request([1, 99999], 8), grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
    ("prompt too long", make_request([5] * 600, 8), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    ("max_tokens 0", make_request([5, 6], 0), grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens"),
    ("huge max_tokens", make_request([5, 6], 2**31), grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens"),
    ("negative temperature", make_request([5, 6], 8, temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ("top_p out of range", make_request([5, 6], 8, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ("too many stop strings", make_request([5, 6], 8, stop=[str(i) for i in range(20)]),
     grpc.StatusCode.INVALID_ARGUMENT, "stopping.stop_strings"),
    ("10 MB prompt", make_request("x" * (10 * 1024 * 1024), 8), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ("chat without a template", make_chat_request([("user", "hi")], 8), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt.chat"),
]


def _unknown_field_request() -> bytes:
    return make_request([5, 6, 7], 4).SerializeToString() + bytes([0xF8, 0x06, 0x01])


def test_bad_requests_get_the_documented_status_and_the_service_keeps_serving(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    for name, request, code, field in BAD_REQUESTS:
        res = stream(gw, request, timeout=30)
        assert res.error == code, (name, res.error, res.details)
        assert field in res.details, (name, res.details)
    with grpc.insecure_channel(gw, options=channel_options()) as channel:
        raw = channel.unary_stream("/splitserve.v1.Gateway/Generate", request_serializer=None,
                                   response_deserializer=gateway_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(raw(_unknown_field_request(), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown field" in info.value.details()
    ok = stream(gw, make_request([5, 6, 7, 8], 4))
    assert ok.error is None and len(ok.token_ids) >= 1
    assert all(idle(s) for s in wait_all_free(gw).values())


def test_client_cancel_mid_stream_frees_both_workers_within_2s(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    prompt = list(range(100, 164))  # 64 tokens: remote prefill
    with grpc.insecure_channel(gw, options=channel_options()) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(make_request(prompt, 400, ignore_eos=True), timeout=60)
        for i, _chunk in enumerate(call):
            if i == 3:
                break
        busy = worker_stats(gw)
        assert any(not idle(s) for s in busy.values())
        call.cancel()
    stats = wait_all_free(gw, within_s=2.0)
    assert all(idle(s) for s in stats.values()), stats


def test_expired_deadline_frees_both_workers_within_2s(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    request = make_request(list(range(200, 300)), 400, ignore_eos=True)
    # The deadline falls a third of the way from the first token to the last, as this machine
    # runs the request undisturbed: mid-decode, with blocks held on both workers. (A fixed 0.5 s
    # stopped expiring once 400 tokens of the test model took 0.44 s; halfway through the first,
    # cold run once let the timed run, its prompt cached and the suite's load lighter, finish.)
    assert stream(gw, request).error is None  # the first: the workers warm, the prompt cached
    warm = stream(gw, request)
    assert warm.error is None, warm.details
    first_s, total_s = warm.timings.first_token_us / 1e6, warm.timings.total_us / 1e6
    deadline_s = first_s + (total_s - first_s) / 3
    res = stream(gw, request, timeout=deadline_s)
    assert res.error == grpc.StatusCode.DEADLINE_EXCEEDED, (deadline_s, len(res.token_ids))
    stats = wait_all_free(gw, within_s=2.0)
    assert all(idle(s) for s in stats.values()), stats


def test_kv_handshake_refuses_a_layout_mismatch_and_nccl_without_a_gpu(cluster: Cluster) -> None:
    from plumbing.transport.nccl import NcclLibrary

    with grpc.insecure_channel(cluster.addresses["decode-0"]) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        bad = kv_transfer_pb2.KVChannelHandshake(
            transport=kv_transfer_pb2.TRANSPORT_KIND_GLOO,
            kv_layout=common_pb2.KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=8, dtype="bfloat16"),
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenKVChannel(bad, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size" in info.value.details() and "dtype" in info.value.details()

        good_layout = worker_layout(cluster)
        nccl = kv_transfer_pb2.KVChannelHandshake(
            transport=kv_transfer_pb2.TRANSPORT_KIND_NCCL, kv_layout=good_layout,
            nccl_unique_id=NcclLibrary().get_unique_id(), timeout_ms=2000, prefill_incarnation=1,
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenKVChannel(nccl, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "CUDA" in info.value.details()
    ok = stream(cluster.addresses["gateway"], make_request(list(range(300, 340)), 4))
    assert ok.error is None  # the decode worker still serves


def worker_layout(cluster: Cluster) -> common_pb2.KVLayout:
    engine_cfg = EngineConfig(model=MODEL)
    from engine.models.spec import load_model_spec

    spec = load_model_spec(MODEL)
    return common_pb2.KVLayout(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                               head_dim=spec.head_dim, block_size=engine_cfg.block_size, dtype="float32")


def test_get_info_lists_the_workers(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
    assert info.model == "target" and info.vocab_size == 4096 and info.max_model_len == 512
    roles = sorted(w.role for w in info.workers)
    assert roles == [common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE]
    assert {w.address for w in info.workers} == {cluster.addresses["prefill-0"], cluster.addresses["decode-0"]}
    assert all(w.load.kv_blocks_total > 0 for w in info.workers)


def test_sigterm_drains_and_every_process_exits_cleanly(tmp_path) -> None:  # noqa: ANN001
    cluster = Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(tmp_path))
    cluster.start()
    try:
        res = stream(cluster.addresses["gateway"], make_request("import os\n", 8))
        assert res.error is None
    finally:
        codes = cluster.stop(grace_s=20)
    assert codes == {"prefill-0": 0, "decode-0": 0, "gateway": 0}, codes
    for name in codes:
        log = (tmp_path / f"{name}.log").read_text()
        assert "draining" in log and "stopped" in log, name


def _scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_metrics_count_what_was_served(cluster: Cluster) -> None:
    res = stream(cluster.addresses["gateway"], make_request(list(range(500, 580)), 6))
    assert res.error is None
    gw = _scrape(cluster.metrics_addresses["gateway"])
    assert gw['splitserve_ttft_seconds_count{model="target"}'] >= 1  # every sample names the model
    assert gw['splitserve_inter_token_latency_seconds_count{model="target"}'] >= 1
    dec = _scrape(cluster.metrics_addresses["decode-0"])
    assert dec['splitserve_kv_transfer_bytes_total{model="target",role="decode"}'] >= res.timings.transfer_bytes > 0
    assert dec['splitserve_kv_blocks_free{model="target",role="decode"}'] > 0
    assert 'splitserve_spec_decode_draft_tokens_total{model="target",role="decode"}' in dec
    # The remotely prefilled request's 5 tokens after the first: 5 decode steps here, no prefill.
    again = stream(cluster.addresses["gateway"], make_request(list(range(700, 780)), 6))
    assert again.error is None and again.timings.transfer_bytes > 0
    after = _scrape(cluster.metrics_addresses["decode-0"])
    step = 'splitserve_engine_step_seconds_count{kind="%s",model="target",role="decode"}'
    assert after[step % "decode"] - dec[step % "decode"] == 5
    assert after.get(step % "prefill", 0.0) == dec.get(step % "prefill", 0.0)


def test_request_id_is_on_the_lines_of_all_three_services(cluster: Cluster) -> None:
    res = stream(cluster.addresses["gateway"], make_request(list(range(600, 660)), 4))
    assert res.error is None
    logs = {name: (cluster.log_dir / f"{name}.log").read_text().splitlines() for name in ("gateway", "prefill-0", "decode-0")}
    done = [json.loads(line) for line in logs["gateway"] if '"request.done"' in line]
    request_id = done[-1]["request_id"]
    for name, lines in logs.items():
        mine = [json.loads(line) for line in lines if request_id in line]
        assert mine, f"{name} logged nothing for request {request_id}"
        assert all(entry.get("request_id") == request_id for entry in mine), name


def test_up_and_generate_commands_from_the_readme(tmp_path) -> None:  # noqa: ANN001
    port = free_port()
    cli = [sys.executable, "-m", "splitserve.cli"]
    # The bundled model (SPLITSERVE_MODEL): the suite downloads nothing here.
    env = {**os.environ, "SPLITSERVE_MODEL": MODEL}
    up = subprocess.Popen([*cli, "up", "--port", str(port), "--local-prefill-max-tokens", "0",
                           "--log-dir", str(tmp_path)], stderr=subprocess.PIPE, env=env)
    try:
        gen = subprocess.run([*cli, "generate", "--gateway", f"127.0.0.1:{port}", "--min-prefill-workers", "1",
                              "def fibonacci(n):", "--max-tokens", "16"], capture_output=True, text=True, timeout=180)
    finally:
        up.send_signal(signal.SIGTERM)
        _, up_err = up.communicate(timeout=60)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def fibonacci(n):") and len(gen.stdout) > len("def fibonacci(n):")
    assert "finish_reason=FINISH_REASON_LENGTH" in gen.stderr and "transfer_bytes=0]" not in gen.stderr
    assert up.returncode == 0, up_err.decode()[-2000:]
    assert '"up.stopped"' in up_err.decode()


def test_one_token_requests_and_logprobs_through_the_split(cluster: Cluster) -> None:
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    prompt = list(range(700, 764))  # remote prefill
    one = stream(cluster.addresses["gateway"], make_request(prompt, 1))
    want_one = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert one.error is None and one.token_ids == want_one.token_ids
    assert one.finish_reason == common_pb2.FINISH_REASON_LENGTH

    request = make_request(prompt, 6)
    request.sampling.logprobs = 2
    with grpc.insecure_channel(cluster.addresses["gateway"]) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=60)
    want = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))[0]
    assert list(reply.token_ids) == want.token_ids
    assert [lp.token_id for lp in reply.logprobs] == want.token_ids
    for got, lp, top in zip(reply.logprobs, want.logprobs, want.top_logprobs):
        assert got.logprob == pytest.approx(lp, abs=1e-4)
        assert set(got.top_logprobs) == set(top)
    assert all(idle(s) for s in wait_all_free(cluster.addresses["gateway"]).values())


def test_only_the_blocks_the_decode_worker_lacks_travel(cluster: Cluster) -> None:
    """A second prompt sharing 4 full blocks with the first: the decode worker reserves them
    from its own prefix cache, and only the other 7 blocks' pages are shipped; the hits show
    in GetStats and Prometheus, and the output is the in-process engine's."""
    gw = cluster.addresses["gateway"]
    decode = cluster.addresses["decode-0"]
    prefix = list(range(2000, 2064))  # 4 blocks of 16 no other test sends
    first, second = prefix + list(range(2100, 2200)), prefix + list(range(2200, 2300))  # 164 tokens: 11 blocks
    before = worker_stats(gw)[decode]
    hits = 'splitserve_prefix_cache_hit_tokens_total{model="target",role="decode"}'
    scraped = _scrape(cluster.metrics_addresses["decode-0"]).get(hits, 0.0)
    res1 = stream(gw, make_request(first, 6))
    res2 = stream(gw, make_request(second, 6))
    assert res1.error is None and res2.error is None
    bytes_per_block = res1.timings.transfer_bytes // 11
    assert res1.timings.transfer_bytes == 11 * bytes_per_block > 0  # nothing of it was cached
    assert res2.timings.transfer_bytes == 7 * bytes_per_block
    after = worker_stats(gw)[decode]
    assert after.num_cached_prompt_tokens - before.num_cached_prompt_tokens == 64
    assert after.num_received_prompt_tokens - before.num_received_prompt_tokens == 164 + 100
    assert _scrape(cluster.metrics_addresses["decode-0"])[hits] - scraped == 64
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    expected = engine.generate([first, second], SamplingParams(temperature=0.0, max_tokens=6))
    assert [res1.token_ids, res2.token_ids] == [o.token_ids for o in expected]
