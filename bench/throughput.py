"""Offline throughput: splitserve's engine vs ``transformers`` on a random-weight Llama (CPU).

    python -m bench.throughput [--num-requests 64] [--output-len 128] [--min-prompt 16]
        [--max-prompt 256] [--seed 0] [--hf-sequential-requests 8]
        [--out bench/results/throughput.json] [--skip-hf-batch]

Runs, one after another in this process and with the same torch thread count:
our ``Engine.generate`` over all requests, ``transformers`` ``generate`` one request at a
time over the first ``--hf-sequential-requests`` requests (batch-1 throughput hardly depends
on the prompt mix, so a sample suffices), and ``transformers`` ``generate_batch`` over all
requests. Prints a table and writes every figure to a JSON file. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.workload import ModelShape, Workload

REPO_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_DIR / ".cache" / "bench-llama-32m"
DEFAULT_OUT = REPO_DIR / "bench" / "results" / "throughput.json"


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
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__,
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


def run(config: BenchConfig) -> dict:
    """Run every system and return the full report (also written to ``config.out_path``)."""
    import torch
    from transformers.utils import logging as hf_logging

    from bench import report, systems, workload as workload_mod

    hf_logging.disable_progress_bar()
    torch.set_num_threads(config.num_threads)
    wl = config.workload
    model_dir = workload_mod.ensure_model(config.model_dir, wl.model, wl.seed)
    prompts = workload_mod.make_prompts(wl)
    settings = systems.EngineSettings.for_workload(wl, config.block_size,
                                                   config.max_num_batched_tokens)
    sampled = prompts[: config.num_hf_sequential_requests]

    cb_kwargs = systems.hf_batch_cache_kwargs(wl, settings, config.hf_page_size)
    plan = [
        ("ours", len(prompts), lambda: systems.run_ours(model_dir, prompts, wl, settings)),
        ("transformers generate, one at a time", len(sampled),
         lambda: systems.run_hf_sequential(model_dir, sampled, wl)),
    ]
    if not config.skip_hf_batch:
        plan.append(("transformers generate_batch", len(prompts),
                     lambda: systems.run_hf_batch(model_dir, prompts, wl, cb_kwargs,
                                                  config.hf_batch_attn)))
    runs = []
    for name, num_requests, run_system in plan:
        _progress(f"{name}: {num_requests} requests")
        load_before = os.getloadavg()[0]
        system_run = run_system()
        # The CPUs may be shared: the load around each system says how far to trust it.
        system_run.details["load_average_1m"] = {"before": load_before,
                                                 "after": os.getloadavg()[0]}
        runs.append(system_run)

    by_name = {r.system: r for r in runs}
    rows = report.result_rows(runs)
    for row in rows:
        if row["system"] == "hf_sequential":
            row["sampled_requests"] = {
                "num_sampled": len(sampled), "of": len(prompts), "which": "the first requests",
                "note": "batch-1 throughput barely depends on the prompt mix, so a sample is timed",
            }
    correctness = {}
    for name in ("ours", "hf_batch"):
        if name in by_name:
            match = report.compare_outputs(by_name[name], by_name["hf_sequential"])
            correctness[f"{name}_vs_hf_sequential"] = None if match is None else match.to_dict()
    ours_match = correctness.get("ours_vs_hf_sequential")
    full = {
        "benchmark": "offline_throughput",
        "command": [sys.executable, "-m", "bench.throughput", *sys.argv[1:]],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": report.git_commit(REPO_DIR),
        "machine": report.machine_description(config.num_threads),
        "workload": {**wl.to_dict(), "max_model_len": wl.max_model_len,
                     "prompt_lens": [len(p) for p in prompts],
                     "num_parameters": workload_mod.count_parameters(model_dir),
                     "dtype": "float32", "decoding": "greedy, ignore_eos",
                     "model_dir": str(model_dir)},
        "results": rows,
        "matches_hf_sequential": None if ours_match is None else ours_match["matches"],
        "correctness": correctness,
    }
    config.out_path.parent.mkdir(parents=True, exist_ok=True)
    config.out_path.write_text(json.dumps(full, indent=2) + "\n")
    return full


def main(argv: list[str] | None = None) -> int:
    from bench import report

    config = parse_args(argv)
    full = run(config)
    sys.stdout.write(report.format_table(full["results"]))
    for name, match in full["correctness"].items():
        summary = "n/a (a system failed)" if match is None else match["matches"]
        sys.stdout.write(f"greedy outputs equal, {name}: {summary}\n")
    sys.stdout.write(f"report: {config.out_path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
