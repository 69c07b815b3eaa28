"""No single point of failure in the control plane: 3 gateway replicas, 2 prefill and 2 decode
workers, real processes. The workers find the gateways through a real DNS server (dnsmasq:
one name, one A record per gateway, each gateway on its own loopback address 127.0.0.2-4,
all on one internal port, as pods behind a headless Service) and register with each.

Under load from the Python client (``splitserve.client.GatewayClient``, all three gateways)
and the official ``openai`` client (through ``splitserve http`` in front of all three), each
gateway in turn is killed with SIGKILL and started again, several rounds. Required: no request
fails, every reply equals the in-process engine's greedy reply (token for token: nothing
duplicated, nothing missing), and every worker's KV pool is whole at the end.

Then a gateway disappears from DNS while streams run through it: they finish (their workers
keep serving them), and the workers leave it: it lists none of them SERVING again, so it
picks none, until it is back in DNS.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import openai
import pytest

from engine import Engine, EngineConfig, SamplingParams
from plumbing.auth import bearer_metadata
from plumbing.resume import ResumePolicy
from splitserve.client import GatewayClient, make_request, wait_for_workers
from splitserve.cluster import Cluster, mint_secret
from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc
from tests.e2e.cluster_util import MODEL, code_prompts
from tests.helpers.dnsmasq import DOMAIN, DnsServer, shared_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gateway_replicas")]

NAME = f"gw.{DOMAIN}"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
LENGTHS = [40, 75, 20, 110, 55, 90]
MAX_TOKENS = [40, 24, 48, 32, 40, 28]
KILL_ROUNDS = 2  # each round kills and restarts every gateway once


@pytest.fixture(scope="module")
def references() -> tuple[list[list[int]], list[list[int]], object]:
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    prompts = code_prompts(engine.tokenizer, LENGTHS)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS])
    return prompts, [list(o.token_ids) for o in outs], engine.tokenizer


@pytest.fixture(scope="module")
def dns() -> DnsServer:
    with DnsServer({NAME: HOSTS}) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(dns: DnsServer, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    port = shared_port(HOSTS)
    logs = tmp_path_factory.mktemp("logs-replicas")
    with Cluster(MODEL, num_prefill=2, num_decode=2, num_gateways=3, gateway_hosts=HOSTS,
                 gateway_internal_port=port, gateway_discovery=dns.spec(NAME, port),
                 internal_secret=mint_secret(), http_port=0, log_dir=str(logs),
                 gateway_flags=["--local-prefill-max-tokens", "0"],
                 worker_flags=["--gateway-refresh-s", "0.5"]) as c:
        yield c


@dataclass
class Tally:
    ok: int = 0
    resumed: int = 0  # replies whose final chunk says the request was resumed on another gateway
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, failure: str | None, resumed: bool = False) -> None:
        with self.lock:
            if failure is None:
                self.ok += 1
                self.resumed += resumed
            else:
                self.failures.append(failure)


def _grpc_load(cluster: Cluster, refs: tuple, stop: threading.Event, tally: Tally, seed: int) -> None:
    prompts, expected, _ = refs
    policy = ResumePolicy(max_retries=60, first_backoff_s=0.05, max_backoff_s=0.5)
    with GatewayClient(cluster.gateway_addresses, policy=policy) as client:
        i = seed
        while not stop.is_set():
            k = i % len(prompts)
            i += 1
            tokens, resumed = [], False
            try:
                for chunk in client.generate(make_request(prompts[k], MAX_TOKENS[k]), timeout_s=240):
                    tokens += list(chunk.token_ids)
                    if chunk.finish_reason:
                        resumed = chunk.timings.resumes > 0
            except grpc.RpcError as exc:
                tally.add(f"grpc prompt {k}: {exc.code().name} {exc.details()}")
                continue
            tally.add(None if tokens == expected[k] else f"grpc prompt {k}: {tokens} != {expected[k]}", resumed)


def _openai_load(cluster: Cluster, refs: tuple, stop: threading.Event, tally: Tally) -> None:
    prompts, expected, tokenizer = refs
    client = openai.OpenAI(base_url=f"http://{cluster.addresses['http']}/v1", api_key="unused", max_retries=0,
                           timeout=240)
    i = 1
    while not stop.is_set():
        k = i % len(prompts)
        i += 1
        want = tokenizer.decode(expected[k])
        try:
            chunks = client.completions.create(model="target", prompt=prompts[k], max_tokens=MAX_TOKENS[k],
                                               temperature=0, stream=True)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        except openai.OpenAIError as exc:
            tally.add(f"openai prompt {k}: {type(exc).__name__}: {exc}")
            continue
        tally.add(None if text == want else f"openai prompt {k}: {text!r} != {want!r}")


def _worker_loads(cluster: Cluster) -> dict[str, common_pb2.WorkerLoad]:
    """Every worker's exact load, asked on its internal port (with the cluster's secret)."""
    metadata = bearer_metadata(cluster.internal_secret)
    loads = {}
    for name in [n for n in cluster.procs if n.startswith(("prefill-", "decode-"))]:
        stub_type = decode_pb2_grpc.DecodeWorkerStub if name.startswith("decode") else prefill_pb2_grpc.PrefillWorkerStub
        with grpc.insecure_channel(cluster.addresses[name]) as channel:
            loads[name] = stub_type(channel).GetStats(common_pb2.GetStatsRequest(), timeout=10, metadata=metadata)
    return loads


def _assert_pools_whole(cluster: Cluster, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        loads = _worker_loads(cluster)
        idle = {n: (s.kv_blocks_free == s.kv_blocks_total and s.kv_blocks_in_transfer == 0
                    and s.num_running == 0 and s.num_waiting == 0) for n, s in loads.items()}
        if all(idle.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {loads}"
        time.sleep(0.2)


def _serving(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=10)
    return sorted(w.address for w in info.workers if w.state == common_pb2.WORKER_STATE_SERVING)


def test_kill_and_restart_each_gateway_under_load_loses_nothing(cluster: Cluster, references: tuple) -> None:
    stop, tally = threading.Event(), Tally()
    threads = [threading.Thread(target=_grpc_load, args=(cluster, references, stop, tally, s)) for s in range(3)]
    threads.append(threading.Thread(target=_openai_load, args=(cluster, references, stop, tally)))
    for t in threads:
        t.start()
    seen_within: list[float] = []
    try:
        for _ in range(KILL_ROUNDS):
            for name in cluster.gateway_names:
                time.sleep(1.5)  # streams in flight on every gateway
                assert cluster.kill(name) == -9
                time.sleep(0.5)
                address = cluster.restart(name)
                ready_at = time.monotonic()  # it listens (its ready file)
                wait_for_workers(address, 2, 2, 60)  # every worker registers with it again
                seen_within.append(time.monotonic() - ready_at)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    print(f"replicas: {tally.ok} replies, {tally.resumed} resumed, every worker listed by a restarted "
          f"gateway {max(seen_within, default=0):.2f} s (worst) after it listened")
    assert tally.failures == []
    assert tally.ok >= 2 * KILL_ROUNDS * len(cluster.gateway_names)
    assert tally.resumed >= 1  # the kills cut streams, and they went on elsewhere
    _assert_pools_whole(cluster)


def test_a_gateway_gone_from_dns_while_streaming_finishes_its_streams_and_is_left(
        cluster: Cluster, dns: DnsServer, references: tuple) -> None:
    prompts, expected, _ = references
    gone = cluster.addresses["gateway-1"]
    workers = sorted(cluster.addresses[n] for n in cluster.procs if n.startswith(("prefill-", "decode-")))
    assert _serving(gone) == workers
    results: dict[int, list[int] | str] = {}
    started = threading.Barrier(len(prompts) + 1)

    def run(k: int) -> None:  # straight to the gateway that goes: no resume, no other gateway
        tokens: list[int] = []
        with grpc.insecure_channel(gone) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(make_request(prompts[k], MAX_TOKENS[k]), timeout=240)
            try:
                for n, chunk in enumerate(call):
                    tokens += list(chunk.token_ids)
                    if n == 0:
                        started.wait(240)
            except grpc.RpcError as exc:
                results[k] = f"{exc.code().name}: {exc.details()}"
                return
        results[k] = tokens

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(240)  # every stream has its first token
    dns.set(NAME, [h for h in HOSTS if h != gone.rsplit(":", 1)[0]])
    deadline = time.monotonic() + 30
    while _serving(gone):
        assert time.monotonic() < deadline, "the workers did not leave the gateway gone from DNS"
        time.sleep(0.1)
    for t in threads:
        t.join(300)
    assert results == dict(enumerate(expected))  # the streams it had finished, token for token
    for _ in range(10):  # left for good: never SERVING there again while out of DNS
        assert _serving(gone) == []
        time.sleep(0.2)
    others = [a for n, a in cluster.addresses.items() if n in cluster.gateway_names and a != gone]
    assert all(_serving(a) == workers for a in others)
    dns.set(NAME, HOSTS)
    wait_for_workers(gone, 2, 2, 30)  # back in DNS: registered with again
    _assert_pools_whole(cluster)
