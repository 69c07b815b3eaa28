"""A queued prefill keeps its decode reservation alive (#25).

The gateway opens the decode leg (a reservation under a lease) before the prompt reaches
the prefill worker. Here the prefill worker computes one prompt at a time in 2-token chunks,
so 12 concurrent 240-token prompts queue there for longer than the gateway's 2 s lease
(1,440 engine steps) even on an idle machine. Without the prefill worker's keep-alive (``RenewLease``) the later
reservations expire and their finished prefills are thrown away; with it none expires, no
leg fails and every reply is the unbroken greedy reply. A prefill worker that stops while
prompts are queued on it (SIGSTOP: alive, silent) renews nothing more, so their
reservations still run out and free their blocks.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from splitserve.cluster import Cluster
from tests.e2e.cluster_util import MODEL, code_prompts, greedy_requests, idle, stream, stream_many, wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_lease")]
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 12, 240, 6
DECODE_METRICS: dict[str, int] = {}


def _metric(name: str) -> float:
    """The decode worker's counter ``name`` (summed over its label sets)."""
    text = urllib.request.urlopen(f"http://{DECODE_METRICS['address']}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-lease")
    # Every service's metrics on a port of its own choosing (metrics_port=0), read back from
    # the cluster: a port picked free here could be taken by another test's process before the
    # worker binds it (it was, once, in a parallel run).
    with Cluster(MODEL, num_prefill=1, num_decode=1, log_dir=str(logs), metrics_port=0,
                 gateway_flags=["--lease-ms", "2000", "--local-prefill-max-tokens", "0"],
                 prefill_flags=["--max-num-seqs", "1", "--max-num-batched-tokens", "2"]) as c:
        DECODE_METRICS["address"] = c.metrics_addresses["decode-0"]
        # The pair's first transfer opens its KV channel (a Gloo rendezvous that can take
        # seconds on a busy machine): done once here, before any lease is measured.
        warm = stream(c.addresses["gateway"], greedy_requests([list(range(40, 80))], [2])[0], 120)
        assert warm.error is None, warm.details
        yield c


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    return code_prompts(AutoTokenizer.from_pretrained(MODEL), [PROMPT_LEN + i for i in range(NUM_PROMPTS)])


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]


def _count(cluster: Cluster, name: str, text: str) -> int:
    assert cluster.log_dir is not None
    return (cluster.log_dir / f"{name}.log").read_text().count(text)


def test_queued_prefills_keep_their_leases(cluster: Cluster, prompts: list[list[int]]) -> None:
    gw = cluster.addresses["gateway"]
    expired_before = _metric("splitserve_kv_leases_expired_total")
    renewed_before = _metric("splitserve_kv_lease_renewals_total")
    failed_before = _count(cluster, "gateway", "request.leg_failed")
    results = stream_many(gw, greedy_requests(prompts, [MAX_TOKENS] * NUM_PROMPTS), timeout=180)
    assert [r.error for r in results] == [None] * NUM_PROMPTS, [(r.error, r.details) for r in results]
    assert [r.token_ids for r in results] == _reference(prompts)
    assert _metric("splitserve_kv_leases_expired_total") == expired_before
    assert _count(cluster, "gateway", "request.leg_failed") == failed_before
    assert _metric("splitserve_kv_lease_renewals_total") - renewed_before >= NUM_PROMPTS  # each one at least once
    stats = wait_all_free(gw, within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats


def test_a_stopped_prefill_worker_renews_nothing_and_its_reservations_expire(
        cluster: Cluster, prompts: list[list[int]]) -> None:
    gw = cluster.addresses["gateway"]
    proc = cluster.procs["prefill-0"]
    expired_before = _metric("splitserve_kv_leases_expired_total")
    done_before = _count(cluster, "prefill-0", "prefill.done")
    result: dict[str, list] = {}
    requests = greedy_requests(prompts, [MAX_TOKENS] * NUM_PROMPTS)
    t = threading.Thread(target=lambda: result.update(r=stream_many(gw, requests, timeout=180)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while _count(cluster, "prefill-0", "prefill.done") == done_before:  # the rest are queued, renewing
            assert time.monotonic() < deadline, "the prefill worker never finished a prompt"
            time.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while _metric("splitserve_kv_leases_expired_total") == expired_before:
            assert time.monotonic() < deadline, "the stopped prefill worker's reservations never expired"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGCONT)
    t.join(200)
    # After an expiry the gateway retries elsewhere (here: the decode worker prefills the
    # prompt itself): the right reply, or a clean error; never a hang or a wrong reply.
    reference = _reference(prompts)
    for res, expected in zip(result["r"], reference):
        if res.error is None:
            assert res.token_ids == expected
    stats = wait_all_free(gw, within_s=10.0)
    assert all(idle(s) for s in stats.values()), stats
