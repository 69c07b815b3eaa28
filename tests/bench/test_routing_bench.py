"""``bench.routing``'s figures on hand-made runs (exact expected values)."""

from __future__ import annotations

from bench.metrics import RequestRecord, ServerTimings
from bench.routing import compare, markdown, summarize


def _record(index: int, turn: int, prompt: int, cached: int, shipped: int, ttft: float,
            tokens: tuple[int, ...] = (7, 8)) -> RequestRecord:
    return RequestRecord(index=index, kind=f"turn-{turn}", num_prompt_tokens=prompt, send_s=0.0,
                         chunk_times_s=(ttft, 1.0), chunk_num_tokens=(1, 1), end_s=1.0,
                         server=ServerTimings(num_cached_prompt_tokens=cached, transfer_bytes=shipped),
                         token_ids=tokens)


def _run(records: list[RequestRecord], counters: dict[str, float]) -> dict:
    return {"records": records, "window_s": 2.0, "load_average_1m": {"before": 1.0, "after": 1.5},
            "routing_counters": counters}


def test_figures_and_goals() -> None:
    load = _run([_record(0, 0, 100, 0, 4096, 0.5), _record(1, 1, 160, 96, 8192, 0.25)],
                {"splitserve_routing_decisions{leg=decode,reason=load}": 2.0})
    prefix = _run([_record(0, 0, 100, 0, 4096, 0.5), _record(1, 1, 160, 144, 0, 0.125, (7, 9))],
                  {"splitserve_routing_predicted_hit_blocks{leg=local}": 9.0})
    figures = {"load": summarize([load]), "prefix": summarize([prefix])}
    assert figures["load"]["prompt_tokens_computed"] == 164 and figures["prefix"]["prompt_tokens_computed"] == 116
    assert figures["prefix"]["kv_bytes_shipped"] == 4096 and figures["prefix"]["num_prefilled_on_decode_worker"] == 1
    assert figures["prefix"]["ttft_p50"] == 0.3125 and figures["prefix"]["ttft_p50_later_turns"] == 0.125
    assert figures["load"]["output_tokens_per_s"] == 2.0 and figures["prefix"]["routing_counters"] == {
        "splitserve_routing_predicted_hit_blocks{leg=local}": 9.0}
    both = summarize([load, load])  # rounds add up
    assert both["seconds"] == 4.0 and both["prompt_tokens_computed"] == 328 and both["output_tokens_per_s"] == 2.0
    result = compare(figures, {p: [r.token_ids for r in run["records"]] for p, run in (("load", load), ("prefix", prefix))})
    ratios = result["prefix_over_load"]
    assert ratios["prompt_tokens_computed"] == 116 / 164 and ratios["kv_bytes_shipped"] == 4096 / 12288
    assert [g["met"] for g in result["goals"]] == [False, False, True]  # TTFT 0.83×, tokens 0.71×, rate 1.0×
    assert result["answers_equal"]["matches"] == "1/2"
    table = markdown(figures, result)
    assert "| prompt tokens computed | 164 | 116 | 0.71× |" in table and "| no |" in table


def test_cold_replica_hit_ratio() -> None:
    from bench.routing_replicas import hit_ratio

    records = [_record(0, 0, 100, 0, 0, 0.5), _record(1, 1, 160, 144, 0, 0.125), _record(2, 1, 140, 96, 0, 0.1)]
    assert hit_ratio(records) == 240 / 400
    assert hit_ratio([]) == 0.0
