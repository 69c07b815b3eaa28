"""End to end, two decode workers run with ``--batch-invariant``: kill -9 of the one running
the most streams mid-stream, and every stream, migrated or not, has the in-process engine's
tokens and logprobs bit for bit. The survivor prefills prompt + tokens sent; with the setting
a prompt's rows are attended as decode rows are, so the stream continues exactly where it
broke (docs/architecture.md, "Batch invariance"); without it only up to near-ties."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import struct
import threading
import time
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from splitserve.client import make_request
from splitserve.cluster import Cluster
from tests.e2e.cluster_util import MODEL, idle, stream, wait_all_free, worker_stats

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_batch_invariant")]

MAX_TOKENS = 400


def _as_float32(values: list[float]) -> list[float]:
    """What a proto ``float`` carries of each value."""
    return [struct.unpack("f", struct.pack("f", v))[0] for v in values]


def test_a_migrated_stream_is_the_unbroken_one_bit_for_bit(tmp_path: Path) -> None:
    prompts = [list(range(50 + i, 90 + i)) for i in range(4)]
    engine = Engine(EngineConfig(model=MODEL, num_threads=1, batch_invariant=True))
    expected = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       logprobs=0))
    requests = [make_request(p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    for request in requests:
        request.sampling.logprobs = 0
    with Cluster(MODEL, num_prefill=0, num_decode=2, log_dir=str(tmp_path), worker_flags=["--batch-invariant"],
                 gateway_flags=["--heartbeat-period-ms", "500", "--heartbeat-miss-count", "4"]) as cluster:
        gw = cluster.addresses["gateway"]
        first_token = threading.Event()
        with cf.ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(stream, gw, r, 60.0, first_token) for r in requests]
            assert first_token.wait(60.0)
            name = {address: n for n, address in cluster.addresses.items()}
            running: dict[str, int] = {}
            deadline = time.monotonic() + 60.0
            while not any(running.values()) and time.monotonic() < deadline:
                if running:
                    time.sleep(0.02)
                running = {name[a]: s.num_running for a, s in worker_stats(gw).items()}
            victim = max(sorted(running), key=lambda n: running[n])
            cluster.procs[victim].send_signal(signal.SIGKILL)
            cluster.procs[victim].wait()
            results = [f.result() for f in futures]
        stats = wait_all_free(gw)
    assert all(r.error is None for r in results), [(r.error, r.details) for r in results]
    assert any(r.timings.migrations for r in results), "no stream was on the killed worker"
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got.token_ids == want.token_ids, i
        assert got.logprobs == _as_float32(want.logprobs), i  # every bit, the migrated part included
    assert all(idle(s) for s in stats.values()), stats
