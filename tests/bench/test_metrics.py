"""Metric arithmetic on hand-made request timelines (exact expected values)."""

from __future__ import annotations

import math
import random

import pytest

from bench.metrics import (
    RequestRecord,
    ServerTimings,
    Slo,
    all_itls_s,
    distribution,
    goodput_rps,
    match_outputs,
    percentile,
    slo_attainment,
    spec_acceptance_rate,
    throughput,
    window_s,
)


def record(index: int, send: float, chunks: list[tuple[float, int]], end: float, prompt: int = 10,
           error: str | None = None, server: ServerTimings | None = None) -> RequestRecord:
    return RequestRecord(index=index, kind="test", num_prompt_tokens=prompt, send_s=send,
                         chunk_times_s=tuple(t for t, _ in chunks),
                         chunk_num_tokens=tuple(n for _, n in chunks), end_s=end, error=error,
                         server=server)


# Four requests over a window of 4 s (sends at 0 and 1, last end at 4). Binary fractions keep
# every expected value exact.
A = record(0, 0.0, [(0.5, 1), (0.625, 1), (0.875, 2)], 1.0, prompt=8)  # TTFT .5, TPOT .125
B = record(1, 0.0, [(0.25, 1), (2.25, 1)], 2.5, prompt=16)               # TTFT .25, TPOT 2
C = record(2, 1.0, [(3.0, 1)], 3.5, prompt=4)                            # TTFT 2, one token
D = record(3, 1.0, [], 4.0, prompt=32, error="UNAVAILABLE")              # failed


def test_request_figures() -> None:
    assert A.ttft_s == 0.5
    assert A.num_output_tokens == 4
    assert A.tpot_s == (0.875 - 0.5) / 3 == 0.125
    assert A.itls_s() == [0.125, 0.25]  # a 2-token chunk is one gap
    assert A.e2e_s == 1.0
    assert B.tpot_s == 2.0
    assert C.tpot_s is None and C.itls_s() == []
    assert not D.ok and D.ttft_s is None and D.num_output_tokens == 0


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, h = 3p/100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5       # h = 1.5
    assert percentile(values, 90) == pytest.approx(3.7, abs=1e-12)   # h = 2.7
    assert percentile(values, 99) == pytest.approx(3.97, abs=1e-12)  # h = 2.97
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    # ranks 0 and 1 of [10, 20]: p25 -> h = 0.25 -> 12.5
    assert percentile([20.0, 10.0], 25) == 12.5


def test_percentile_matches_numpy_default() -> None:
    numpy = pytest.importorskip("numpy")
    rng = random.Random(0)
    values = [rng.expovariate(1.0) for _ in range(101)]
    for p in (1, 37.5, 50, 90, 99, 99.9):
        assert percentile(values, p) == pytest.approx(float(numpy.percentile(values, p)), rel=1e-12)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_in_milliseconds() -> None:
    dist = distribution([0.001, 0.002, 0.003, 0.004], scale=1000.0)
    assert dist["mean"] == pytest.approx(2.5)
    assert dist["p50"] == pytest.approx(2.5)
    assert dist["p90"] == pytest.approx(3.7)
    assert dist["p99"] == pytest.approx(3.97)


def test_window_throughput_and_itls() -> None:
    records = [A, B, C, D]
    assert window_s(records) == 4.0
    rates = throughput(records, 4.0)
    assert rates.requests_per_s == 3 / 4               # the failed request does not count
    assert rates.output_tokens_per_s == (4 + 2 + 1) / 4
    assert rates.input_tokens_per_s == (8 + 16 + 4) / 4
    assert sorted(all_itls_s(records)) == [0.125, 0.25, 2.0]
    # only gaps that end inside [0.7, 2.3]: A's 0.875 (gap .25) and B's 2.25 (gap 2)
    assert sorted(all_itls_s(records, within=(0.7, 2.3))) == [0.25, 2.0]


def test_goodput_counts_requests_meeting_both_slos() -> None:
    records = [A, B, C, D]
    # A: TTFT .5 <= .5, TPOT .125 <= .25 -> meets. B: TPOT 2 > .25 -> misses.
    # C: TTFT 2 > .5 -> misses. D failed.
    slo = Slo(ttft_s=0.5, tpot_s=0.25)
    assert [slo.met_by(r) for r in records] == [True, False, False, False]
    assert goodput_rps(records, slo, 4.0) == 0.25
    assert slo_attainment(records, slo) == 0.25
    # a looser TTFT lets C in: it has one token, so no TPOT to miss
    loose = Slo(ttft_s=2.0, tpot_s=0.25)
    assert [loose.met_by(r) for r in records] == [True, False, True, False]
    assert goodput_rps(records, loose, 4.0) == 0.5
    assert slo_attainment(records, loose) == 0.5


def test_slo_and_goodput_validation() -> None:
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0, tpot_s=1.0)
    with pytest.raises(ValueError):
        goodput_rps([A], Slo(1.0, 1.0), 0.0)


def test_spec_acceptance_rate_pools_all_requests() -> None:
    with_drafts = [
        record(0, 0.0, [(1.0, 3)], 1.0, server=ServerTimings(num_draft_tokens=8, num_accepted_tokens=6)),
        record(1, 0.0, [(1.0, 1)], 1.0, server=ServerTimings(num_draft_tokens=4, num_accepted_tokens=0)),
    ]
    assert spec_acceptance_rate(with_drafts) == 0.5  # 6 of 12
    assert spec_acceptance_rate([A, B]) is None


def test_record_validation() -> None:
    with pytest.raises(ValueError):
        record(0, 0.0, [(1.0, 0)], 1.0)
    assert math.isclose(record(0, 0.0, [(1.0, 1)], 1.0).e2e_s, 1.0)


def test_match_outputs_counts_equal_requests_and_first_divergence() -> None:
    match = match_outputs([[1, 2, 3], [4, 5, 6], [7, 8], [9]], [[1, 2, 3], [4, 0, 6], [7, 8, 9]])
    assert (match.num_equal, match.num_compared) == (1, 3)  # the 4th request has no reference
    assert match.first_divergence == {1: 1, 2: 2}  # a prefix diverges where the shorter one ends
    assert match.fraction == "1/3"
    assert match.to_dict()["first_divergence"] == {"1": 1, "2": 2}
