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


def test_the_summary_compares_round_by_round() -> None:
    def rounds(values: list[float]) -> list[dict[str, float]]:
        return [dict.fromkeys(METRICS, v) for v in values]

    # B lower in rounds 0 and 2 only; the per-round ratios 0.5, 2, 0.9 have the median 0.9,
    # which the ratio of the medians (4 / 4 = 1) would not give.
    summary = summarize({"A": rounds([4.0, 2.0, 10.0]), "B": rounds([2.0, 4.0, 9.0])})
    assert set(summary) == set(METRICS)
    assert summary["itl_ms"] == {"a": 4.0, "b": 4.0, "b_over_a": 0.9, "b_lower": 2, "rounds": 3}
