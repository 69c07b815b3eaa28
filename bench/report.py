"""Turning :class:`SystemRun`s into the printed table and the JSON report."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.systems import SystemRun

SYSTEM_LABELS = {
    "ours": "splitserve Engine.generate",
    "hf_sequential": "transformers generate (batch 1)",
    "hf_batch": "transformers generate_batch",
}


def machine_description(num_threads: int) -> dict:
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_version": torch.__version__,
        "torch_num_threads": num_threads,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "transformers_version": transformers.__version__,
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def git_commit(repo_dir: Path) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(repo_dir), "rev-parse", "HEAD"],
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


@dataclass(frozen=True)
class Match:
    """How many of ``num_compared`` requests had identical greedy outputs in two systems, and
    where each differing request first diverged (request index -> token position)."""

    num_equal: int
    num_compared: int
    first_divergence: dict[int, int]

    @property
    def fraction(self) -> str:
        return f"{self.num_equal}/{self.num_compared}"

    def to_dict(self) -> dict:
        return {"matches": self.fraction, "num_equal": self.num_equal,
                "num_compared": self.num_compared,
                "first_divergence": {str(k): v for k, v in self.first_divergence.items()}}


def compare_outputs(candidate: SystemRun, reference: SystemRun) -> Match | None:
    """Compare the first ``len(reference.output_ids)`` requests of both runs token by token."""
    if candidate.error is not None or reference.error is not None:
        return None
    num_compared = min(len(candidate.output_ids), len(reference.output_ids))
    divergence: dict[int, int] = {}
    for i in range(num_compared):
        ours, theirs = candidate.output_ids[i], reference.output_ids[i]
        if ours != theirs:
            divergence[i] = next(
                (pos for pos, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)),
            )
    return Match(num_compared - len(divergence), num_compared, divergence)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0.0:
        return None
    return value / base


def result_rows(runs: list[SystemRun]) -> list[dict]:
    """One dict per system with every figure, ratios included."""
    by_name = {run.system: run for run in runs}
    hf_seq = by_name.get("hf_sequential")
    ours = by_name.get("ours")
    hf_seq_tps = hf_seq.output_tokens_per_s if hf_seq else None
    ours_tps = ours.output_tokens_per_s if ours else None
    rows = []
    for run in runs:
        tps = run.output_tokens_per_s
        row = {
            "system": run.system,
            "label": SYSTEM_LABELS.get(run.system, run.system),
            "num_requests": run.num_requests,
            "num_output_tokens": run.num_output_tokens,
            "seconds": run.seconds,
            "output_tokens_per_s": tps,
            "ratio_vs_hf_sequential": _ratio(tps, hf_seq_tps),
            "ratio_vs_ours": _ratio(tps, ours_tps),
            "error": run.error,
            "details": run.details,
        }
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = ("system", "requests", "output tokens", "seconds", "output tok/s",
              "vs HF batch-1", "vs ours")
    lines = []
    for row in rows:
        if row["error"] is not None:
            lines.append((row["label"], str(row["num_requests"]), "-", "-", "FAILED", "-", "-"))
            continue
        lines.append((
            row["label"],
            str(row["num_requests"]),
            str(row["num_output_tokens"]),
            _fmt(row["seconds"], ".2f"),
            _fmt(row["output_tokens_per_s"], ".1f"),
            _fmt(row["ratio_vs_hf_sequential"], ".2f") + ("x" if row["ratio_vs_hf_sequential"] else ""),
            _fmt(row["ratio_vs_ours"], ".2f") + ("x" if row["ratio_vs_ours"] else ""),
        ))
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def render(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return " | ".join([first, *rest])

    rule = "-+-".join("-" * width for width in widths)
    out = [render(header), rule, *(render(line) for line in lines)]
    for row in rows:
        if row["error"] is not None:
            out.append(f"{row['label']} failed: {row['error']}")
    return "\n".join(out) + "\n"
