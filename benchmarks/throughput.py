"""Offline throughput: splitserve's engine vs ``transformers`` on a random-weight Llama (CPU).

    python -m benchmarks.throughput [--num-requests 64] [--output-len 128] [--min-prompt 16]
        [--max-prompt 256] [--seed 0] [--hf-sequential-requests 8]
        [--out bench/results/throughput.json] [--skip-hf-batch]

Runs, one after another in this process and with the same torch thread count:
our ``Engine.generate`` over all requests, ``transformers`` ``generate`` one request at a
time over the first ``--hf-sequential-requests`` requests (batch-1 throughput hardly depends
on the prompt mix, so a sample suffices), and ``transformers`` ``generate_batch`` over all
requests. Prints a table and writes every figure to a JSON file. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.workload import ENGINE_MODEL_DIR, ModelShape, Workload

DEFAULT_MODEL_DIR = ENGINE_MODEL_DIR
DEFAULT_OUT = Path("bench/results/throughput.json")
SYSTEM_LABELS = {
    "ours": "splitserve Engine.generate",
    "hf_sequential": "transformers generate (batch 1)",
    "hf_batch": "transformers generate_batch",
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs, built once from the command line."""

    workload: Workload
    num_hf_sequential_requests: int
    out_path: Path
    model_dir: Path
    skip_hf_batch: bool
    block_size: int
    max_num_batched_tokens: int
    hf_page_size: int
    hf_batch_attn: str
    num_threads: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_hf_sequential_requests <= self.workload.num_requests:
            raise ValueError(
                f"--hf-sequential-requests must be in [1, {self.workload.num_requests}], "
                f"got {self.num_hf_sequential_requests}"
            )
        if self.block_size < 1 or self.hf_page_size < 1:
            raise ValueError("--block-size and --hf-page-size must be >= 1")
        if self.num_threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.num_threads}")


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    parser.add_argument("--hf-sequential-requests", type=int, default=8,
                        help="how many of the requests transformers runs one at a time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="where the random-weight model is saved (reused if present)")
    parser.add_argument("--skip-hf-batch", action="store_true")
    parser.add_argument("--block-size", type=int, default=16, help="our engine's KV block size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget per step, for our engine and generate_batch")
    parser.add_argument("--hf-page-size", type=int, default=256,
                        help="generate_batch's page size (its default)")
    parser.add_argument("--hf-batch-attn", default="sdpa",
                        help="attention implementation for generate_batch ('sdpa' or 'paged|eager')")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch intra-op threads, the same for every system "
                             "(default: os.cpu_count())")
    args = parser.parse_args(argv)
    try:
        workload = Workload(
            num_requests=args.num_requests, output_len=args.output_len,
            min_prompt_len=args.min_prompt, max_prompt_len=args.max_prompt, seed=args.seed,
            model=ModelShape(),
        )
        return BenchConfig(
            workload=workload, num_hf_sequential_requests=args.hf_sequential_requests,
            out_path=args.out, model_dir=args.model_dir, skip_hf_batch=args.skip_hf_batch,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            hf_page_size=args.hf_page_size, hf_batch_attn=args.hf_batch_attn,
            num_threads=args.threads,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _progress(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


def _plan(config: BenchConfig, model_dir: Path, prompts: list[list[int]]) -> list[tuple[str, int, object]]:
    """(name, requests, run) per system; ``run()`` returns its ``SystemRun``."""
    from benchmarks import systems

    wl = config.workload
    settings = systems.EngineSettings.for_workload(wl, config.block_size, config.max_num_batched_tokens)
    sampled = prompts[: config.num_hf_sequential_requests]
    cb_kwargs = systems.hf_batch_cache_kwargs(wl, settings, config.hf_page_size)
    plan = [
        ("ours", len(prompts), lambda: systems.run_ours(model_dir, prompts, wl, settings)),
        ("transformers generate, one at a time", len(sampled),
         lambda: systems.run_hf_sequential(model_dir, sampled, wl)),
    ]
    if not config.skip_hf_batch:
        plan.append(("transformers generate_batch", len(prompts),
                     lambda: systems.run_hf_batch(model_dir, prompts, wl, cb_kwargs, config.hf_batch_attn)))
    return plan


def _correctness(runs: list) -> dict:
    """Greedy outputs of ours and generate_batch against generate (batch 1), request by request."""
    from bench.metrics import match_outputs

    by_name = {r.system: r for r in runs}
    reference = by_name["hf_sequential"]
    correctness = {}
    for name in ("ours", "hf_batch"):
        if name in by_name:
            ok = by_name[name].error is None and reference.error is None
            match = match_outputs(by_name[name].output_ids, reference.output_ids) if ok else None
            correctness[f"{name}_vs_hf_sequential"] = None if match is None else match.to_dict()
    return correctness


def run(config: BenchConfig) -> dict:
    """Run every system and return the full report (also written to ``config.out_path``)."""
    import torch
    from transformers.utils import logging as hf_logging

    from bench import report, workload as workload_mod
    from bench.machine import load_window

    hf_logging.disable_progress_bar()
    torch.set_num_threads(config.num_threads)
    wl = config.workload
    model_dir = workload_mod.ensure_model(config.model_dir, wl.model, wl.seed)
    prompts = workload_mod.make_prompts(wl)
    runs = []
    for name, num_requests, run_system in _plan(config, model_dir, prompts):
        _progress(f"{name}: {num_requests} requests")
        with load_window() as load:
            system_run = run_system()
        system_run.details["load_average_1m"] = load
        runs.append(system_run)
    rows = result_rows(runs)
    for row in rows:
        if row["system"] == "hf_sequential":
            row["sampled_requests"] = {
                "num_sampled": config.num_hf_sequential_requests, "of": len(prompts), "which": "the first requests",
                "note": "batch-1 throughput barely depends on the prompt mix, so a sample is timed",
            }
    correctness = _correctness(runs)
    ours_match = correctness.get("ours_vs_hf_sequential")
    full = {
        **report.header("offline_throughput", config.num_threads),
        "workload": {**wl.to_dict(), "max_model_len": wl.max_model_len,
                     "prompt_lens": [len(p) for p in prompts],
                     "num_parameters": workload_mod.count_parameters(model_dir),
                     "dtype": "float32", "decoding": "greedy, ignore_eos", "model_dir": str(model_dir)},
        "results": rows,
        "matches_hf_sequential": None if ours_match is None else ours_match["matches"],
        "correctness": correctness,
    }
    report.write_json(full, config.out_path)
    return full


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0.0:
        return None
    return value / base


def result_rows(runs: list) -> list[dict]:
    """One dict per ``SystemRun`` with every figure, ratios included."""
    by_name = {run.system: run for run in runs}
    hf_seq_tps = by_name["hf_sequential"].output_tokens_per_s if "hf_sequential" in by_name else None
    ours_tps = by_name["ours"].output_tokens_per_s if "ours" in by_name else None
    return [{
        "system": run.system, "label": SYSTEM_LABELS.get(run.system, run.system),
        "num_requests": run.num_requests, "num_output_tokens": run.num_output_tokens,
        "seconds": run.seconds, "output_tokens_per_s": run.output_tokens_per_s,
        "ratio_vs_hf_sequential": _ratio(run.output_tokens_per_s, hf_seq_tps),
        "ratio_vs_ours": _ratio(run.output_tokens_per_s, ours_tps),
        "error": run.error, "details": run.details,
    } for run in runs]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def format_table(rows: list[dict]) -> str:
    header = ("system", "requests", "output tokens", "seconds", "output tok/s", "vs HF batch-1", "vs ours")
    lines = []
    for row in rows:
        if row["error"] is not None:
            lines.append((row["label"], str(row["num_requests"]), "-", "-", "FAILED", "-", "-"))
            continue
        lines.append((row["label"], str(row["num_requests"]), str(row["num_output_tokens"]),
                      _fmt(row["seconds"], ".2f"), _fmt(row["output_tokens_per_s"], ".1f"),
                      _fmt(row["ratio_vs_hf_sequential"], ".2f", "x"), _fmt(row["ratio_vs_ours"], ".2f", "x")))
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def render(cells: tuple[str, ...]) -> str:
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return " | ".join([cells[0].ljust(widths[0]), *rest])

    out = [render(header), "-+-".join("-" * width for width in widths), *(render(line) for line in lines)]
    out += [f"{row['label']} failed: {row['error']}" for row in rows if row["error"] is not None]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    full = run(config)
    sys.stdout.write(format_table(full["results"]))
    for name, match in full["correctness"].items():
        summary = "n/a (a system failed)" if match is None else match["matches"]
        sys.stdout.write(f"greedy outputs equal, {name}: {summary}\n")
    sys.stdout.write(f"report: {config.out_path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
