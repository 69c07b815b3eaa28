"""kill -9 of a prefill worker mid-transfer; leases on the decode worker; full pools and queues.

The prefill workers here stall 2 s between announcing a transfer and sending it (a fault
injection flag), the gateway asks for 1 s leases, and the decode worker lets a prefill worker's
keep-alives (RenewLease) hold a reservation at most 1.5 s (``--max-reservation-hold-ms``), so
every remote prefill is caught "mid-transfer" and every decode reservation runs out its lease
although its prefill worker still renews it.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from splitserve.client import make_request
from splitserve.cluster import Cluster
from tests.e2e.cluster_util import MODEL, idle, stream, wait_all_free, worker_stats

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_faults")]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].token_ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-faults")
    with Cluster(MODEL, num_prefill=2, num_decode=1, log_dir=str(logs),
                 gateway_flags=["--lease-ms", "1000", "--local-prefill-max-tokens", "16", "--local-prefill-spill-tokens", "0",
                                "--reservation-wait-ms", "300", "--max-in-flight", "3"],
                 prefill_flags=["--fault-transfer-stall-s", "2.0", "--kv-channel-timeout-s", "5"],
                 decode_flags=["--kv-channel-timeout-s", "5", "--num-kv-blocks", "48",
                               "--max-reservation-hold-ms", "1500"]) as c:
        yield c


def test_kill_9_of_the_prefill_worker_mid_transfer(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=stream(gw, make_request(list(range(40, 104)), 8), 30)))
    t.start()
    # Find the prefill worker holding packed pages (announced, stalled before the send).
    holder = None
    deadline = time.monotonic() + 10
    while holder is None and time.monotonic() < deadline:
        for address, load in worker_stats(gw).items():
            if load.kv_blocks_in_transfer > 0 and address in (cluster.addresses["prefill-0"], cluster.addresses["prefill-1"]):
                holder = address
        time.sleep(0.02)
    assert holder is not None, "the transfer was never caught in flight"
    name = next(n for n, a in cluster.addresses.items() if a == holder)
    cluster.procs[name].send_signal(signal.SIGKILL)
    cluster.procs[name].wait()
    t.join(60)
    res = result["r"]
    # Retried on the other prefill worker (which stalls past the 1 s lease too), then, with
    # no prefill worker left to try, prefilled on the decode worker itself: the right
    # tokens, or a clean UNAVAILABLE; never a hang or garbage.
    if res.error is None:
        assert res.token_ids == reference(list(range(40, 104)), 8)
    else:
        assert res.error == grpc.StatusCode.UNAVAILABLE and res.token_ids == [], (res.error, res.details)
    stats = wait_all_free(gw, within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats


def test_leases_expire_and_short_prompts_still_work(cluster: Cluster) -> None:
    gw = cluster.addresses["gateway"]
    log_path = cluster.log_dir / "decode-0.log"
    before = log_path.read_text().count("lease expired")
    # A prompt no worker's cache holds (prefix routing would prefill a cached one locally).
    prompt = list(range(300, 340))
    res = stream(gw, make_request(prompt, 8), 30)
    if res.error is None:  # every prefill worker failed its lease; the decode worker prefilled
        assert res.token_ids == reference(prompt, 8)
    else:
        assert res.error == grpc.StatusCode.UNAVAILABLE, res.details
    assert log_path.read_text().count("lease expired") > before  # the decode worker freed a reservation
    short = stream(gw, make_request([5, 6, 7, 8, 9], 6), 30)  # prefilled on the decode worker
    assert short.error is None and len(short.token_ids) >= 1
    stats = wait_all_free(gw, within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats


def test_full_pool_and_full_gateway_are_resource_exhausted(cluster: Cluster) -> None:
    """Two 300-token prompts hold 38 of the decode worker's 48 blocks while their transfers
    stall; a third cannot reserve within 300 ms, and of five more sent at once, one exceeds
    the gateway's max_in_flight of 3."""
    gw = cluster.addresses["gateway"]
    decode = cluster.addresses["decode-0"]
    results: dict[int, object] = {}
    holders = [threading.Thread(target=lambda i=i: results.update({i: stream(gw, make_request(
        list(range(1000 + i, 1300 + i)), 4), 30)})) for i in range(2)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if worker_stats(gw)[decode].kv_blocks_in_transfer >= 38:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the two reservations never showed up")
    third = stream(gw, make_request(list(range(2000, 2300)), 4), 30)
    assert third.error == grpc.StatusCode.RESOURCE_EXHAUSTED, (third.error, third.details)
    assert "KV pool" in third.details
    while worker_stats(gw)[decode].kv_blocks_in_transfer < 38 and time.monotonic() < deadline + 5:
        time.sleep(0.02)
    # Five more at once: each stays in flight for the 2 s stall (or the 300 ms reservation
    # wait), so at least one finds 3 in flight even if the holders' leases already ran out.
    extra = [threading.Thread(target=lambda i=i: results.update({10 + i: stream(gw, make_request(
        list(range(3000 + i, 3050 + i)), 4), 30)})) for i in range(5)]
    for t in extra:
        t.start()
    for t in holders + extra:
        t.join(60)
    codes = [r.error for r in results.values()]
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, [(r.error, r.details) for r in results.values()]
    assert any("max_in_flight" in r.details for r in results.values())
    stats = wait_all_free(gw, within_s=5.0)
    assert all(idle(s) for s in stats.values()), stats
