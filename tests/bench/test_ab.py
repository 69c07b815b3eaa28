"""bench/ab.py: alternating rounds, summaries, ratios and the table, on hand-made bursts."""

from __future__ import annotations

from bench import ab


def _burst(name: str, seconds: float, order: list[str]):  # noqa: ANN202
    def run() -> dict:
        order.append(name)
        return {"seconds": seconds, "ttft_s": [0.01, 0.02], "output_tokens": 100, "errors": []}
    return run


def test_rounds_alternate_and_ratios_compare_same_round_pairs() -> None:
    order: list[str] = []
    runs = ab.alternate({"base": _burst("base", 1.0, order), "new": _burst("new", 2.0, order)}, rounds=3)
    assert order == ["base", "new", "new", "base", "base", "new"]
    results = {name: ab.summary(runs[name]) for name in runs}
    assert results["base"]["output_tokens_per_s_rounds"] == [100.0, 100.0, 100.0]
    assert results["new"]["output_tokens_per_s"] == 50.0
    results["base"]["extra_ms"], results["new"]["extra_ms"] = 2.0, 3.0
    q = ab.ratios(results, "new", "base", ["extra_ms"])
    assert q == {"output_tokens_per_s": 0.5, "output_tokens_per_s_same_round_median": 0.5,
                 "ttft_p50": 1.0, "ttft_p99": 1.0, "extra": 1.5}
    results["q"] = q
    table = ab.markdown(results, "way", ("base", "new"), "q", {"extra ms": "extra_ms"}).splitlines()
    assert table[0] == "| way | output tok/s (median of rounds) | TTFT P50 ms | TTFT P99 ms | extra ms |"
    assert table[1] == "| --- | --- | --- | --- | --- |"
    assert table[3].startswith("| new | 50.0 |") and table[3].endswith("| 3.00 |")
    assert table[4] == "| new / base | 0.500× (same-round pairs: 0.500×) | 1.000× | 1.000× | 1.50× |"
