"""Run each step of the GPU check in its own process, under the run's time budget, and
write the report.

A step is a child process (``python -m bench.gpu.step``): a CUDA error that poisons its
context, a crash or a hang costs that step only. The child gets a deadline and writes its
figures to a JSON file; one that outlives its time limit is killed. Each step's entry in the
report is ``{"status": "ok" | "failed" | "skipped", "elapsed_s", "figures"}`` or, instead of
figures, ``"error"`` (and the tail of its log) or ``"reason"``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import structlog

from bench import report
from bench.gpu import goals, markdown
from bench.gpu.options import GpuCheckOptions

log = structlog.get_logger()
SCHEMA = "splitserve-gpu-check/1"
# Each step's share of the budget (its time limit; the last step gets what is left).
SHARES = {"build": 0.1, "kernels": 0.25, "bandwidth": 0.15, "parity": 0.3, "handoff": 0.3, "throughput": 1.0}
MIN_STEP_S = 5.0
KILL_MARGIN_S = 15.0  # the child's own deadline is this much before its kill


def _child_env(options: GpuCheckOptions) -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if options.dry_run:
        env["TRITON_INTERPRET"] = "1"  # read when triton.jit runs: before the child imports triton
    return env


def _tail(path: Path, num_chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-num_chars:]


def run_step(name: str, options: GpuCheckOptions, limit_s: float) -> dict:
    """Run one step's child process for at most ``limit_s`` seconds; its report entry."""
    work = options.out_dir / "steps"
    work.mkdir(parents=True, exist_ok=True)
    options_path, result_path, log_path = work / "options.json", work / f"{name}.json", work / f"{name}.log"
    options_path.write_text(json.dumps(options.to_dict()))
    result_path.unlink(missing_ok=True)
    deadline_s = max(MIN_STEP_S, limit_s - KILL_MARGIN_S) if limit_s > 2 * KILL_MARGIN_S else limit_s * 0.8
    cmd = [sys.executable, "-m", "bench.gpu.step", name, str(options_path), str(result_path), f"{deadline_s:.1f}"]
    start = time.monotonic()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(options))
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    entry: dict = {"elapsed_s": round(time.monotonic() - start, 2), "time_limit_s": round(limit_s, 1)}
    if rc is None:
        return {**entry, "status": "failed", "error": f"killed after its time limit of {limit_s:.0f} s",
                "log_tail": _tail(log_path)}
    if rc != 0 or not result_path.is_file():
        return {**entry, "status": "failed", "error": f"step process exited with code {rc}", "log_tail": _tail(log_path)}
    result = json.loads(result_path.read_text())
    if "error" in result:
        return {**entry, "status": "failed", **result, "log_tail": _tail(log_path)}
    return {**entry, "status": "ok", "figures": result["figures"]}


def run_all(options: GpuCheckOptions) -> dict:
    """Every selected step in order, within the budget; the whole report."""
    start = time.monotonic()
    steps: dict[str, dict] = {}
    for name in options.steps:
        remaining = options.budget_s - (time.monotonic() - start)
        if remaining < MIN_STEP_S:
            steps[name] = {"status": "skipped", "reason": f"the run's budget of {options.budget_s:.0f} s is spent"}
            continue
        limit = remaining if name == options.steps[-1] else min(remaining, SHARES[name] * options.budget_s)
        log.info("gpu_check.step", step=name, time_limit_s=round(limit, 1))
        steps[name] = run_step(name, options, limit)
        log.info("gpu_check.step_done", step=name, status=steps[name]["status"], elapsed_s=steps[name]["elapsed_s"])
    for name in (s for s in goals.ALL_STEPS if s not in options.steps):
        steps[name] = {"status": "skipped", "reason": "not selected (--steps)"}
    doc = {"schema": SCHEMA, **report.header("gpu_check", 1), "mode": "dry" if options.dry_run else "device",
           "options": options.to_dict(), "steps": steps}
    doc["goals"] = goals.evaluate(steps, options.dry_run)
    doc["failures"] = [name for name, entry in steps.items() if entry["status"] == "failed"]
    doc["incomplete"] = [name for name in options.steps if steps[name]["status"] != "ok"]
    doc["elapsed_s"] = round(time.monotonic() - start, 1)
    return doc


def _logs_text(out_dir: Path) -> str:
    """Every step's log, and the hand-off cluster's services' logs, one after the other."""
    parts = []
    for path in sorted((out_dir / "steps").glob("*.log")) + sorted((out_dir / "steps").glob("*/*.log")):
        parts.append(f"===== {path.relative_to(out_dir)} =====\n{path.read_text(errors='replace')}")
    return "\n".join(parts)


def write(doc: dict, out_dir: Path) -> list[Path]:
    """``gpu_check.json``, ``gpu_check.md`` and ``gpu_check_logs.txt`` (every step's log) in
    ``out_dir``, and under ``$OUT`` too when it is set (the device machine sends back what is
    there: a few files, so the logs travel as one)."""
    json_path = report.write_json(doc, out_dir / "gpu_check.json")
    md_path = out_dir / "gpu_check.md"
    md_path.write_text(markdown.render(doc))
    logs_path = out_dir / "gpu_check_logs.txt"
    logs_path.write_text(_logs_text(out_dir))
    written = [json_path, md_path, logs_path]
    device_out = os.environ.get("OUT")
    if device_out and Path(device_out).resolve() != out_dir.resolve():
        Path(device_out).mkdir(parents=True, exist_ok=True)
        for path in (json_path, md_path, logs_path):
            written.append(Path(shutil.copy(path, Path(device_out) / path.name)))
    return written
