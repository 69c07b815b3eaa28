"""End to end with 2 prefill + 2 decode workers: parity, and kill -9 of a decode worker
(its streams migrate to the survivor)."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time

import grpc
import pytest

from engine import Engine, EngineConfig, SamplingParams
from splitserve.client import make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.cluster_util import (MODEL, code_prompts, greedy_requests, idle, stream, stream_many, wait_all_free,
                                    worker_stats)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_2x2")]

LENGTHS = [2, 9, 20, 33, 40, 48, 50, 64, 70, 90, 110, 128, 130, 140, 160, 170,
           180, 190, 200, 210, 220, 230, 240, 250, 256, 260, 270, 280, 290, 295, 299, 300]
MAX_TOKENS = [10 + (11 * i) % 37 for i in range(len(LENGTHS))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-2x2")
    # Speculative decoding (n-gram) on the decode workers: greedy output must not change.
    with Cluster(MODEL, num_prefill=2, num_decode=2, log_dir=str(logs),
                 gateway_flags=["--heartbeat-period-ms", "500", "--heartbeat-miss-count", "4"],
                 decode_flags=["--speculative", "ngram", "--num-speculative-tokens", "4"],
                 # 2 blocks a message: the pages of most prompts travel in several messages
                 prefill_flags=["--kv-chunk-bytes", "65536", "--kv-channels-per-peer", "2"]) as c:
        yield c


def test_32_concurrent_greedy_requests_match_the_in_process_engine(cluster: Cluster) -> None:
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    prompts = code_prompts(engine.tokenizer, LENGTHS)
    expected = [o.token_ids for o in engine.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS])]
    results = stream_many(cluster.addresses["gateway"], greedy_requests(prompts, MAX_TOKENS))
    for i, (res, want) in enumerate(zip(results, expected)):
        assert res.error is None, (i, res.error, res.details)
        assert res.token_ids == want, f"request {i} (prompt {LENGTHS[i]} tokens) diverged"
    assert sum(r.timings.num_draft_tokens for r in results) > 0  # speculation did run
    stats = wait_all_free(cluster.addresses["gateway"])
    assert len(stats) == 4 and all(idle(s) for s in stats.values()), stats


def test_conversations_return_to_the_decode_worker_holding_them(cluster: Cluster) -> None:
    """Prefix routing (the default): two conversations run side by side for three turns, each
    turn resending the whole conversation. From the second turn on, each is prefilled on the
    decode worker that decoded its previous turn, from its prefix cache (only that worker
    holds the previous answer's K/V), with nothing shipped; outputs equal the in-process
    engine's."""
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    firsts = code_prompts(engine.tokenizer, [150, 140])
    users = code_prompts(engine.tokenizer, [30, 25, 35, 20, 28, 33, 31, 26])[2:]  # later user turns
    gw = cluster.addresses["gateway"]
    histories = [list(p) for p in firsts]
    for turn in range(3):
        prompts = [h + (users[2 * turn - 2 + i] if turn else []) for i, h in enumerate(histories)]
        results = stream_many(gw, greedy_requests(prompts, [20, 20]))
        expected = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
        for i, (res, want) in enumerate(zip(results, expected)):
            assert res.error is None, (turn, i, res.error, res.details)
            assert res.token_ids == want.token_ids, (turn, i)
            if turn:
                computed = len(histories[i]) - 1  # the last answer token's K/V is never computed
                assert res.timings.transfer_bytes == 0, (turn, i)  # prefilled where it was held
                assert res.timings.num_cached_prompt_tokens == computed // 16 * 16, (turn, i)
            histories[i] = prompts[i] + res.token_ids
    stats = wait_all_free(gw)
    assert all(idle(s) for s in stats.values()), stats


def test_kill_9_of_a_decode_worker_mid_stream(cluster: Cluster) -> None:
    """Streams on the killed worker migrate to the survivor (prompt + tokens sent prefilled
    there): every stream completes, equal to the in-process engine's, each token once. Once
    streaming has begun, the victim is the decode worker running the most of them (its own
    GetStats): a fixed victim, killed once every stream had its first token, was once running
    none of them in a loaded CI run (the quickest streams had finished, with n-gram speculation
    taking up to 5 tokens a step, while others were still being prefilled)."""
    gw = cluster.addresses["gateway"]
    deadline_s = 60.0
    prompts = [list(range(50 + i, 90 + i)) for i in range(6)]
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    expected = [o.token_ids for o in engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True))]
    requests = [make_request(p, 450, ignore_eos=True) for p in prompts]
    first_token = threading.Event()
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(stream, gw, r, deadline_s, first_token) for r in requests]
        assert first_token.wait(deadline_s)  # streaming has begun
        name = {address: n for n, address in cluster.addresses.items()}
        running: dict[str, int] = {}
        deadline = time.monotonic() + deadline_s
        while not any(running.values()) and time.monotonic() < deadline:
            if running:
                time.sleep(0.02)  # none running yet: ask again shortly, not in a tight loop
            running = {name[a]: s.num_running for a, s in worker_stats(gw).items() if name[a].startswith("decode")}
        victim = max(sorted(running), key=lambda n: running[n])
        survivor = "decode-1" if victim == "decode-0" else "decode-0"
        cluster.procs[victim].send_signal(signal.SIGKILL)
        cluster.procs[victim].wait()
        results = [f.result() for f in futures]
    assert all(r.error is None for r in results), [(r.error, r.details) for r in results]
    for i, (r, want) in enumerate(zip(results, expected)):
        assert r.token_ids == want, f"stream {i} differs from the in-process engine"
    migrated = [r for r in results if r.timings.migrations]
    assert migrated, "no stream was on the killed worker"
    assert all(r.timings.migrations == 1 for r in migrated)
    # New requests: all served by the survivor.
    after = stream_many(gw, [make_request(list(range(10 + i, 60 + i)), 12) for i in range(8)])
    assert all(r.error is None and len(r.token_ids) >= 1 for r in after), [(r.error, r.details) for r in after]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with grpc.insecure_channel(gw) as channel:
            info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
        decode = [w for w in info.workers if w.role == common_pb2.WORKER_ROLE_DECODE]
        if len(decode) == 1:
            break
        time.sleep(0.1)
    assert [w.address for w in decode] == [cluster.addresses[survivor]]
    stats = wait_all_free(gw)
    assert all(idle(s) for s in stats.values()), stats
