"""Peers bookkeeping: best of thread counts, greedy match, a row's figures, the command's flags (no
models run)."""

from __future__ import annotations

import pytest

from bench.report import figure_problems
from benchmarks.peers import (ALL_PEERS, PeerResult, best_of_threads, greedy_match, parse_args, peer_row,
                              profile_from_args)


def result(seconds: float, ids: tuple[tuple[int, ...], ...] = ((1, 2), (3, 4)), **kw: object) -> PeerResult:
    return PeerResult("engine", len(ids), seconds=seconds, output_ids=ids, **kw)


def test_best_of_threads_keeps_the_fastest_and_records_all() -> None:
    runs = {1: result(2.0), 2: result(8.0)}  # 4 tokens: 2 tok/s on 1 thread, 0.5 on 2
    best = best_of_threads(lambda n: runs[n], (1, 2))
    assert best.seconds == 2.0
    assert best.details["threads"] == 1
    assert best.details["by_threads"] == {"1": 2.0, "2": 0.5}


def test_best_of_threads_with_a_failure_and_all_skipped() -> None:
    runs = {1: PeerResult("engine", 2, error="boom"), 2: result(4.0)}
    best = best_of_threads(lambda n: runs[n], (1, 2))
    assert best.details["threads"] == 2 and best.details["by_threads"] == {"1": "boom", "2": 1.0}
    skipped = best_of_threads(lambda n: PeerResult("vllm_cpu", 2, skipped="not installed"), (1, 2))
    assert skipped.skipped == "not installed" and skipped.output_tokens_per_s is None


def test_peer_rows_ratio_match_and_skips() -> None:
    engine = result(2.0)
    other = result(1.0, ((1, 2), (3, 5)))
    assert greedy_match(other, engine) == "1/2"
    row = peer_row(other, engine.output_tokens_per_s, engine)
    assert row["status"] == "ok" and row["figures"]["ratio_vs_engine"] == 2.0
    assert row["greedy_match_vs_engine"] == "1/2"
    missing = peer_row(PeerResult("vllm_cpu", 2, skipped="not installed"), 2.0, engine)
    assert missing["status"] == "skipped" and missing["figures"] == {"skipped": "not installed"}
    failed = peer_row(PeerResult("disaggregated", 2, error="UNAVAILABLE"), 2.0, engine)
    assert failed["status"] == "failed" and failed["reason"] == "UNAVAILABLE"
    assert figure_problems({"systems": [row, missing, failed]}) == []


def test_the_command_takes_the_profiles_systems_and_thread_counts() -> None:
    profile, threads = profile_from_args(parse_args(["--profile", "full", "--threads", "4"]))
    assert profile.systems == ALL_PEERS
    assert threads("engine") == (1, 4) and threads("hf_generate_batch") == (4,)
    tiny, tiny_threads = profile_from_args(parse_args(["--profile", "tiny", "--systems", "engine, colocated",
                                                       "--peer-threads", "1,2"]))
    assert tiny.systems == ("engine", "colocated") and not tiny.engine_workload
    assert tiny_threads("engine") == (1, 2)
    with pytest.raises(ValueError, match=r"--systems: unknown system\(s\) \['sglang'\]"):
        profile_from_args(parse_args(["--systems", "engine,sglang"]))
    with pytest.raises(ValueError, match="--threads and --peer-threads must be >= 1"):
        profile_from_args(parse_args(["--peer-threads", "0"]))
