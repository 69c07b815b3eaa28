"""``python -m bench.gpu --dry-run`` end to end: every step of the GPU check on the CPU with
tiny shapes and the Triton kernels interpreted (what runs on an H200 when one is lent).
Checks the report's structure and that every kernel check and greedy comparison passed;
not its speeds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.options import DRY, STEPS

# One worker runs the module: the dry run (a few minutes of subprocesses) happens once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gpu_check")]
ROOT = Path(__file__).resolve().parents[2]
KERNEL_FAMILIES = {"paged_attention", "int8_kv_attention", "int8_kv_write", "write_kv", "pack_kv", "unpack_kv",
                   "int8_matmul", "int4_matmul"}
COPIES = {"int8_kv_write", "write_kv", "pack_kv", "unpack_kv"}


def run_check(out: Path, *flags: str, timeout_s: float = 900, device_out: Path | None = None) -> tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPLITSERVE_GPU_CHECK_CACHE_DIR=str(out / "cache"))
    env.pop("OUT", None)  # the device tool's folder, set on the device machine only
    if device_out is not None:
        env["OUT"] = str(device_out)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    report_path = out / "gpu_check.json"
    assert report_path.is_file(), proc.stderr[-3000:]
    return proc.returncode, json.loads(report_path.read_text()), (out / "gpu_check.md").read_text()


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, str]:
    return run_check(tmp_path_factory.mktemp("gpu-check"))


def test_every_step_ran_and_the_run_passed(dry_report: tuple[int, dict, str]) -> None:
    rc, doc, md = dry_report
    failed = {name: entry.get("error") for name, entry in doc["steps"].items() if entry["status"] != "ok"}
    assert failed == {}
    assert rc == 0 and doc["failures"] == [] and doc["incomplete"] == []
    assert doc["schema"] == "splitserve-gpu-check/1" and doc["mode"] == "dry"
    assert list(doc["steps"]) == list(STEPS)
    for name in STEPS:
        assert f"## {name}: ok" in md


def test_build_step_says_nothing_is_built(dry_report: tuple[int, dict, str]) -> None:
    build = dry_report[1]["steps"]["build"]["figures"]
    assert build["native_extension"]["built"] is False
    assert build["triton_interpreter"] is True and build["ops_run_triton_on_this_device"] is False


def test_every_kernel_equals_its_reference(dry_report: tuple[int, dict, str]) -> None:
    fig = dry_report[1]["steps"]["kernels"]["figures"]
    checks = fig["checks"]
    assert {c["name"].split("/")[0] for c in checks} == KERNEL_FAMILIES
    assert fig["all_passed"] is True and fig["num_checks"] == len(checks) == fig["num_passed"]
    for c in checks:
        assert c["passed"] is True, c
        assert c["max_abs_err"] <= c["atol"] + c["rtol"] * 10, c  # references are O(1)-valued
        if c["name"].split("/")[0] in COPIES:
            assert c["max_abs_err"] == 0.0 and c["atol"] == c["rtol"] == 0.0, c
    float32_attention = [c for c in checks if c["name"].startswith("paged_attention/") and c["dtype"] == "float32"]
    assert len(float32_attention) == 4 and all(c["max_abs_err"] < 1e-5 for c in float32_attention)


def test_greedy_parity_in_both_dtypes(dry_report: tuple[int, dict, str]) -> None:
    fig = dry_report[1]["steps"]["parity"]["figures"]
    assert "skipped" in fig["smollm2"]
    for name in ("random", "bundled"):
        for dtype in ("float32", "bfloat16"):
            result = fig[name][dtype]
            assert result["matches"] == f"{DRY.parity_prompts}/{DRY.parity_prompts}", (name, dtype, result)
            assert result["divergences"] == [] and result["mean_common_prefix"] == DRY.parity_new_tokens
    goals = {g["id"]: g for g in dry_report[1]["goals"]}
    assert goals["kernels_equal_references"]["met"] is True
    assert goals["greedy_float32_identical"]["met"] is True and goals["greedy_bfloat16_drift"]["met"] is True
    for speed in ("paged_attention_bandwidth", "decode_roofline_batch64"):
        assert goals[speed]["met"] is None and "dry run" in goals[speed]["why"]


def test_bandwidth_and_throughput_figures(dry_report: tuple[int, dict, str]) -> None:
    steps = dry_report[1]["steps"]
    bw = steps["bandwidth"]["figures"]
    assert bw["copy"]["bytes"] == DRY.copy_bytes and bw["copy"]["gb_per_s"] > 0
    att = bw["attention"]
    assert att["kv_bytes"] == 2 * DRY.attention_seqs * DRY.attention_context * 2 * 16 * 2  # K+V, bf16
    assert att["triton"]["gb_per_s"] > 0 and att["sdpa_best"] in att["sdpa"]
    assert att["sdpa"][att["sdpa_best"]]["max_abs_diff_vs_triton"] < 0.05
    tp = steps["throughput"]["figures"]
    assert list(tp["batches"]) == ["1", "2"]
    for batch, r in tp["batches"].items():
        assert r["truncated"] is False and r["output_tokens"] == int(batch) * 8
        assert r["decode_steps"] == 7  # the first token comes from the prefill step
        assert math.isfinite(r["decode_gb_per_s"]) and r["decode_gb_per_s"] > 0
        per_step = tp["model"]["weight_bytes_read_per_step"]
        assert r["mean_bytes_per_decode_step"] > per_step  # weights, then the K/V it read


def test_handoff_ships_every_prompts_pages_over_gloo(dry_report: tuple[int, dict, str]) -> None:
    fig = dry_report[1]["steps"]["handoff"]["figures"]
    assert fig["transport"] == "gloo" and "NCCL cannot join two ranks on one GPU" in fig["note"]
    assert fig["all_prefilled_remotely"] is True and len(fig["requests"]) == DRY.handoff_requests
    pages = -(-DRY.handoff_prompt_len // 16)
    for r in fig["requests"]:
        assert r["transfer_bytes"] == pages * 16 * fig["model_kv_bytes_per_token"]
        assert r["gb_per_s"] > 0
    assert set(fig["exit_codes"].values()) == {0}


def test_a_failing_step_keeps_the_others_figures(tmp_path: Path) -> None:
    # A prompt longer than the tiny model's positions: the throughput step fails; build still reports.
    device_out = tmp_path / "device-out"
    rc, doc, md = run_check(tmp_path / "out", "--steps", "build,throughput", "--prompt-len", "5000", timeout_s=600,
                            device_out=device_out)
    assert rc == 1 and doc["failures"] == ["throughput"]
    assert doc["steps"]["build"]["status"] == "ok" and "torch_version" in doc["steps"]["build"]["figures"]
    assert "max_model_len" in doc["steps"]["throughput"]["error"] or "5000" in doc["steps"]["throughput"]["error"]
    assert doc["steps"]["kernels"] == {"status": "skipped", "reason": "not selected (--steps)"}
    assert "## throughput: failed" in md
    # On the device machine the reports are also written under $OUT, the logs as one file.
    assert sorted(p.name for p in device_out.iterdir()) == ["gpu_check.json", "gpu_check.md", "gpu_check_logs.txt"]
    assert json.loads((device_out / "gpu_check.json").read_text()) == doc
    logs = (device_out / "gpu_check_logs.txt").read_text()
    assert "===== steps/build.log =====" in logs and "===== steps/throughput.log =====" in logs


def test_an_exhausted_budget_skips_steps_and_fails_the_run(tmp_path: Path) -> None:
    rc, doc, _ = run_check(tmp_path, "--steps", "build,kernels", "--budget-s", "1", timeout_s=300)
    assert rc == 1 and doc["incomplete"] == ["build", "kernels"]
    assert all("budget" in doc["steps"][s]["reason"] for s in ("build", "kernels"))


# -- the goals and the Markdown on hand-made device results (no GPU here) ----------------------


def _device_steps(attention_vs_copy: float, batch64_roofline: float) -> dict:
    kernel = {"name": "paged_attention/decode", "dtype": "bfloat16", "max_abs_err": 0.001, "atol": 1e-6,
              "rtol": 2**-7, "passed": True}
    broken = {"name": "matmuls", "error": "CompilationError: boom", "max_abs_err": None, "atol": None,
              "rtol": None, "passed": False}
    same = {"identical": True, "matches": "8/8", "mean_common_prefix": 32.0, "divergences": []}
    drift = {"identical": False, "matches": "7/8", "mean_common_prefix": 30.0,
             "divergences": [{"prompt": 3, "position": 17, "margin": 0.01, "margin_of_spread": 0.001}]}
    ok = "ok"
    return {
        "kernels": {"status": ok, "figures": {"device": "cuda", "num_checks": 2, "num_passed": 1, "all_passed": False,
                                              "failed": ["matmuls"], "checks": [kernel, broken]}},
        "parity": {"status": ok, "figures": {"device": "cuda", "smollm2": {"skipped": "no --smollm2"},
                                             "random": {"float32": same, "bfloat16": drift},
                                             "bundled": {"float32": same, "bfloat16": {"error": "RuntimeError: x"}}}},
        "bandwidth": {"status": ok, "figures": {"copy": {"gb_per_s": 4300.0}, "attention": {
            "triton_vs_copy": attention_vs_copy, "triton": {"gb_per_s": 4300.0 * attention_vs_copy},
            "sdpa": {"flash": {"gb_per_s": 3000.0}, "cudnn": {"skipped": "no"}}, "num_seqs": 64, "context": 4096,
            "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}}},
        "throughput": {"status": ok, "figures": {"copy_gb_per_s": 4300.0, "batches": {
            "64": {"roofline_fraction": batch64_roofline, "output_tok_per_s": 5000.0, "truncated": False},
            "256": {"error": "OutOfMemoryError: CUDA out of memory"}}}},
        "handoff": {"status": "failed", "error": "killed after its time limit of 135 s", "log_tail": ""},
    }


def test_goals_on_device_results() -> None:
    from bench.gpu import goals

    met = {g["id"]: g for g in goals.evaluate(_device_steps(0.75, 0.42), dry_run=False)}
    assert met["kernels_equal_references"]["met"] is False and met["kernels_equal_references"]["measured"] == "1/2"
    assert met["greedy_float32_identical"]["met"] is True
    assert met["greedy_float32_identical"]["measured"] == {"random": "8/8", "bundled": "8/8"}
    assert met["greedy_bfloat16_drift"]["met"] is None and "bundled" in met["greedy_bfloat16_drift"]["why"]
    assert met["paged_attention_bandwidth"] == {"id": "paged_attention_bandwidth", "goal": met["paged_attention_bandwidth"]["goal"],
                                                "measured": 0.75, "met": True}
    assert met["decode_roofline_batch64"]["measured"] == 0.42 and met["decode_roofline_batch64"]["met"] is False
    steps = _device_steps(0.69, 0.5)
    steps["parity"]["figures"]["bundled"]["bfloat16"] = dict(steps["parity"]["figures"]["random"]["bfloat16"])
    steps["parity"]["figures"]["bundled"]["bfloat16"]["divergences"] = [
        {"prompt": 0, "position": 2, "margin": 3.0, "margin_of_spread": 0.2}]  # no near-tie: a bug
    met = {g["id"]: g for g in goals.evaluate(steps, dry_run=False)}
    assert met["paged_attention_bandwidth"]["met"] is False and met["decode_roofline_batch64"]["met"] is True
    assert met["greedy_bfloat16_drift"]["met"] is False
    assert met["greedy_bfloat16_drift"]["measured"]["gaps"] == [0.001, 0.2]


def test_markdown_renders_failures_and_errors() -> None:
    from bench.gpu import goals, markdown

    steps = _device_steps(0.75, 0.42)
    doc = {"mode": "device", "timestamp": "t", "git_commit": None, "elapsed_s": 400.0, "steps": steps,
           "goals": goals.evaluate(steps, dry_run=False)}
    md = markdown.render(doc)
    assert "# GPU check (device run)" in md and "## handoff: failed" in md
    assert "killed after its time limit of 135 s" in md
    assert "| matmuls | float32 | CompilationError: boom | – | **no** |" in md
    assert "- bundled bfloat16: RuntimeError: x" in md
    assert "| 256 | OutOfMemoryError: CUDA out of memory |" in md
    assert "| Triton paged attention (K/V read) | 3225.000 | 0.750 |" in md
    del steps["bandwidth"]["figures"]["copy"]  # a renderer missing a figure costs its section only
    md = markdown.render(doc)
    assert "(not rendered: KeyError: 'copy'" in md and "## throughput: ok" in md
