"""The report's figure check, goals and Markdown, on hand-made report fragments."""

from __future__ import annotations

import math

from bench.report import figure_problems, goals, is_skipped


def test_figure_problems_accepts_positive_numbers_and_reasoned_skips() -> None:
    report = {
        "online": {"runs": [{"figures": {"ttft_ms": {"p50": 1.5, "p99": 3.0}, "goodput_rps": 0.0,
                                         "slo_attainment": 0.0, "spec": {"skipped": "speculation off"}},
                             "counts": {"num_failed": 0}}]},
        "cost": {"figures": {"usd_per_m_output_tokens": 0.1}},
    }
    assert figure_problems(report) == []


def test_figure_problems_flags_zero_nan_negative_and_silent_skips() -> None:
    report = {"peers": {"systems": [{"figures": {"output_tokens_per_s": 0.0, "seconds": math.nan,
                                                 "ratio_vs_engine": -1.0, "x": {"skipped": ""},
                                                 "y": "fast", "z": True}}]}}
    problems = figure_problems(report)
    assert len(problems) == 6
    assert any("output_tokens_per_s: 0.0 is not positive" in p for p in problems)
    assert any("seconds: nan is not a finite number" in p for p in problems)
    assert any("skipped without a reason" in p for p in problems)


def _peers(**tps: float | None) -> dict:
    rows = []
    for system, value in tps.items():
        if value is None:
            rows.append({"system": system, "status": "skipped", "figures": {"skipped": "not installed"}})
        else:
            rows.append({"system": system, "status": "ok", "figures": {"output_tokens_per_s": value}})
    return {"systems": rows}


def test_goals_are_measured_ratios_or_reasons() -> None:
    report = {"peers": _peers(engine=400.0, vllm_cpu=None, disaggregated=360.0),
              "interference": {"figures": {"itl_p99_ratio_disaggregated_vs_colocated": 0.25}}}
    by_goal = {row["goal"]: row for row in goals(report)}
    vllm = by_goal["engine_vs_vllm_cpu"]
    assert vllm["met"] is None and is_skipped(vllm["figures"]["measured"])
    assert "vllm_cpu" in vllm["figures"]["measured"]["skipped"]
    assert by_goal["disaggregated_vs_engine"]["figures"]["measured"] == 0.9
    assert by_goal["disaggregated_vs_engine"]["met"] is True
    assert by_goal["itl_p99_disaggregated_vs_colocated"]["met"] is True
    report["peers"] = _peers(engine=400.0, vllm_cpu=500.0, disaggregated=200.0)
    by_goal = {row["goal"]: row for row in goals(report)}
    assert by_goal["engine_vs_vllm_cpu"]["figures"]["measured"] == 0.8
    assert by_goal["engine_vs_vllm_cpu"]["met"] is False
    assert by_goal["disaggregated_vs_engine"]["met"] is False
    assert figure_problems({"goals": goals(report)}) == []
