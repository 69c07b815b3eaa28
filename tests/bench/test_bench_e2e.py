"""``splitserve bench --profile tiny`` end to end: real gateway and worker processes, a tiny
workload, the fast peers (vLLM pointed at a missing interpreter, so it must be skipped with
a reason). Checks the report's structure, not its speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import figure_problems, is_skipped

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_tiny(out: Path) -> tuple[dict, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--profile", "tiny", "--out", str(out),
           "--no-progress", "--peers", "engine,hf_generate,vllm_cpu,disaggregated,colocated",
           "--vllm-python", str(out / "no-such-venv" / "python"), "--threads", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return report, proc


@pytest.mark.slow
def test_tiny_profile_report(tmp_path: Path) -> None:
    """One test (one run of the profile, also under pytest-xdist), three groups of checks."""
    report, proc = run_tiny(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_structure(report)
    check_sections(report)
    check_markdown_and_plots(tmp_path, report)


def check_structure(report: dict) -> None:
    for key in ("schema", "machine", "config", "online", "cost", "peers", "interference", "goals", "plots"):
        assert key in report, key
    assert report["failures"] == []
    for section in ("online", "cost", "peers", "interference"):
        assert not is_skipped(report[section]), report[section]
    assert figure_problems(report) == []
    assert report["machine"]["cpu_count"] >= 1


def check_sections(report: dict) -> None:
    runs = report["online"]["runs"]
    assert [r["name"] for r in runs] == ["capacity", "sweep-0", "sweep-1", "long_mix"]
    for run in runs:
        figs = run["figures"]
        assert run["counts"]["num_failed"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(figs[key]) == {"mean", "p50", "p90", "p99"}
        # every prompt goes to the prefill worker, so every request moved KV pages
        assert set(figs["kv_transfer_ms"]) == {"mean", "p50", "p90", "p99"}
        assert run["requests"] and run["kv_timeline"]
    assert set(report["cost"]["figures"]) >= {"usd_per_m_output_tokens", "usd_per_m_input_tokens",
                                               "break_even_output_tokens_per_month"}
    systems = {row["system"]: row for row in report["peers"]["systems"]}
    assert set(systems) == {"engine", "hf_generate", "vllm_cpu", "disaggregated", "colocated"}
    assert systems["vllm_cpu"]["status"] == "skipped" and "not installed" in systems["vllm_cpu"]["reason"]
    for name in ("engine", "hf_generate", "disaggregated", "colocated"):
        assert systems[name]["status"] == "ok", systems[name]
    # greedy decoding: our deployments give the in-process engine's tokens
    assert systems["disaggregated"]["greedy_match_vs_engine"] == "6/6"
    assert systems["colocated"]["greedy_match_vs_engine"] == "6/6"
    modes = report["interference"]["modes"]
    assert set(modes) == {"disaggregated", "colocated"}
    assert "itl_p99_ratio_disaggregated_vs_colocated" in report["interference"]["figures"]
    goals = {row["goal"]: row for row in report["goals"]}
    assert goals["engine_vs_vllm_cpu"]["met"] is None   # skipped, with the reason
    assert is_skipped(goals["engine_vs_vllm_cpu"]["figures"]["measured"])


def check_markdown_and_plots(out: Path, report: dict) -> None:
    md = (out / "report.md").read_text()
    for heading in ("## Goals", "## Online load", "## Cost", "## Peers", "## Disaggregation vs colocation"):
        assert heading in md
    assert set(report["plots"]) == {"latency_cdfs.png", "throughput_goodput_vs_rate.png", "peers.png",
                                    "interference_itl_cdf.png", "kv_utilisation.png"}
    for name in report["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert f"]({name})" in md
