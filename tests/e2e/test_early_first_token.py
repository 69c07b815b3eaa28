"""The first token before the transfer, and kill -9 around it (issue #13).

The prefill workers stall 1.5 s between announcing a transfer and sending its pages (a fault
injection flag), so the first token — streamed by the decode worker as soon as the transfer
is announced — reaches the client while the pages are still held on the prefill side. Then
either side is killed: the client gets the in-process tokens exactly once (the request is
continued elsewhere with the first token counted as sent), or a clean UNAVAILABLE after a
prefix of them, and every block is free on every survivor.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from splitserve.client import make_request
from splitserve.cluster import Cluster
from tests.e2e.cluster_util import MODEL, Streamed, idle, stream, wait_all_free, worker_stats

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_early_first_token")]
NUM_TOKENS = 8


def reference(prompt: list[int]) -> list[int]:
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))[0].token_ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-early-first-token")
    with Cluster(MODEL, num_prefill=2, num_decode=2, log_dir=str(logs),
                 gateway_flags=["--local-prefill-max-tokens", "16", "--routing", "load"],
                 prefill_flags=["--fault-transfer-stall-s", "1.5", "--kv-channel-timeout-s", "5",
                                "--kv-chunk-bytes", "65536"],  # 2 blocks a message
                 decode_flags=["--kv-channel-timeout-s", "5"]) as c:
        yield c


def _first_token_then_kill(cluster: Cluster, prompt: list[int], role: str) -> Streamed:
    """Stream ``prompt``; once its first token arrived, kill -9 the worker of ``role`` that
    still has the request's pages in transfer. Returns the whole stream."""
    gw = cluster.addresses["gateway"]
    started = threading.Event()
    result: dict[str, Streamed] = {}
    t = threading.Thread(target=lambda: result.update(r=stream(gw, make_request(prompt, NUM_TOKENS), 60, started)))
    t.start()
    assert started.wait(15), "no first token"
    names = [n for n in cluster.addresses if n.startswith(role)]
    holder = None
    deadline = time.monotonic() + 1.0  # well inside the 1.5 s stall
    while holder is None and time.monotonic() < deadline:
        stats = worker_stats(gw)
        holder = next((n for n in names if cluster.addresses[n] in stats
                       and stats[cluster.addresses[n]].kv_blocks_in_transfer > 0), None)
    assert holder is not None, "the first token came after the pages, not before"
    cluster.procs[holder].send_signal(signal.SIGKILL)
    cluster.procs[holder].wait()
    t.join(60)
    return result["r"]


def _check(res: Streamed, expected: list[int], gw: str) -> None:
    if res.error is None:
        assert res.token_ids == expected  # every token exactly once, no gap
    else:
        assert res.error == grpc.StatusCode.UNAVAILABLE, (res.error, res.details)
        assert res.token_ids and res.token_ids == expected[:len(res.token_ids)]
    stats = wait_all_free(gw, within_s=8.0)
    assert all(idle(s) for s in stats.values()), stats


def test_kill_9_of_the_decode_worker_before_its_first_chunk(cluster: Cluster) -> None:
    prompt = list(range(200, 264))
    res = _first_token_then_kill(cluster, prompt, "decode")
    _check(res, reference(prompt), cluster.addresses["gateway"])
    assert res.error is None and res.timings.migrations == 1  # continued on the other decode worker


def test_kill_9_of_the_prefill_worker_after_the_first_token(cluster: Cluster) -> None:
    prompt = list(range(40, 104))
    res = _first_token_then_kill(cluster, prompt, "prefill")
    _check(res, reference(prompt), cluster.addresses["gateway"])
