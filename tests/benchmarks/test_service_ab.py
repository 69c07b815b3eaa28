"""benchmarks/service_ab.py's pure parts: its KEY=VALUE parsing and its per-round summary."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.service_ab import METRICS, parse_env, summarize


def test_env_pairs_parse_and_a_pair_without_a_key_or_sign_is_refused() -> None:
    assert parse_env(["GOMP_SPINCOUNT=20000", "X=", "Y=a=b"]) == {"GOMP_SPINCOUNT": "20000", "X": "", "Y": "a=b"}
    for bad in ("GOMP_SPINCOUNT", "=1"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            parse_env([bad])


def _rounds(values: list[list[float]]) -> list[list[dict[str, float]]]:
    """Per round, one record per cluster of the side, every metric at the value given."""
    return [[dict.fromkeys(METRICS, v) for v in clusters] for clusters in values]


def test_the_summary_compares_round_by_round() -> None:
    # B lower in rounds 0 and 2 only; the per-round ratios 0.5, 2, 0.9 have the median 0.9,
    # which the ratio of the medians (4 / 4 = 1) would not give.
    summary = summarize({"A": _rounds([[4.0], [2.0], [10.0]]), "B": _rounds([[2.0], [4.0], [9.0]])})
    assert set(summary) == set(METRICS)
    assert summary["itl_ms"] == {"a": 4.0, "b": 4.0, "b_over_a": 0.9, "b_lower": 2, "rounds": 3,
                                 "replica_spread": {"a": 1.0, "b": 1.0}}


def test_with_replicas_a_round_is_its_clusters_mean_and_their_spread_is_reported() -> None:
    # A's two clusters: 4 / 6 (mean 5, spread 1.5), 2 / 2 (2, 1), 8 / 10 (9, 1.25);
    # B's: 3 / 3 (3, 1), 4 / 8 (6, 2), 9 / 9 (9, 1). B/A per round 0.6, 3, 1 -> 1.
    summary = summarize({"A": _rounds([[4.0, 6.0], [2.0, 2.0], [8.0, 10.0]]),
                         "B": _rounds([[3.0, 3.0], [4.0, 8.0], [9.0, 9.0]])})
    assert summary["tok_s"] == {"a": 5.0, "b": 6.0, "b_over_a": 1.0, "b_lower": 1, "rounds": 3,
                                "replica_spread": {"a": 1.25, "b": 1.0}}
