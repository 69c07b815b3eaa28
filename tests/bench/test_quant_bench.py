"""bench.quant's arithmetic: greedy agreement and the goal table."""

from bench.quant import goals
from bench.quant_quality import agreement


def test_agreement_counts_identical_prefixes_and_positions() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 9, 4], [5, 6, 7, 8]]
    out = agreement(ref, got)
    assert out["identical_prefix_tokens"] == [2, 4]
    assert out["identical_prefix_share"] == 6 / 8 and out["positionwise_share"] == 7 / 8
    assert not out["all_identical"] and agreement(ref, ref)["all_identical"]


def test_goals_read_each_figure_and_compare_it_with_its_bound() -> None:
    report = {
        "quality": {"ppl_ratio": {"int8": 1.02, "int4-g32": 1.05, "kv-int8": 1.0}},
        "speed": {"batch1_tok_s_ratio": {"int8": 2.1, "int4-g32": 2.4},
                  "batch64_tok_s_ratio": {"int8": 0.95, "int4-g32": 0.7, "kv-int8": 1.0}},
        "bytes": {"handoff_bytes_ratio": {"kv-int8": 0.27}},
    }
    met = {g["figure"]: g["met"] for g in goals(report)}
    assert met == {"ppl_ratio.int8": False, "ppl_ratio.int4-g32": True, "ppl_ratio.kv-int8": True,
                   "batch1_tok_s_ratio.int8": True, "batch1_tok_s_ratio.int4-g32": False,
                   "batch64_tok_s_ratio.int8": True, "batch64_tok_s_ratio.int4-g32": False,
                   "batch64_tok_s_ratio.kv-int8": True, "handoff_bytes_ratio.kv-int8": True}


def test_goals_leave_out_the_configs_a_run_did_not_measure() -> None:
    report = {"speed": {"batch1_tok_s_ratio": {"int8": 2.0}, "batch64_tok_s_ratio": {"int8": 0.8}}}
    assert [(g["figure"], g["met"]) for g in goals(report)] == [
        ("batch1_tok_s_ratio.int8", True), ("batch64_tok_s_ratio.int8", False)]
