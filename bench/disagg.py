"""Disaggregated deployment vs the in-process Engine, and KV transfer vs raw Gloo (not a test).

    python -m bench.disagg [--num-requests 64] [--output-len 128] [--out bench/results/disagg.json]

Side by side, in one run, on the engine benchmark's workload (``bench/workload.py``: a 32M
random Llama in float32, prompts of 16–256 random tokens, 128 greedy tokens, EOS ignored):

* ``in-process``: ``Engine.generate`` over all prompts, with 1 torch thread and with
  threads = cores (2 here); the faster of the two is the baseline.
* ``disaggregated``: ``splitserve up``'s processes — gateway + 1 prefill + 1 decode worker,
  one torch thread per worker — every prompt prefilled remotely (``--local-prefill-max-tokens 0``)
  and its pages shipped over Gloo; all requests sent at once through the gateway (grpc.aio).
* ``colocated``: gateway + 1 decode worker, no prefill worker (every prompt prefilled on the
  decode worker), one thread.
* raw Gloo: ``bench.kv_transfer``'s bare ``ProcessGroupGloo`` send of the median per-request
  KV payload, in two fresh processes, against the per-request transfer the deployment timed
  (``PhaseTimings.transfer_us``: the prefill's announce → its last message sent, or, when
  longer, the decode worker's announce → its last page written; the whole hand-off with its
  control plane). The one-at-a-time phase sends the longest prompts reversed, so the decode
  worker's prefix cache (which keeps the burst's prompts) does not shrink their transfers.

Greedy outputs of every deployment are compared with the in-process Engine's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench import report
from bench.deployment import DeploymentPool, DeploymentSpec, engine_flags, send_all
from bench.machine import load_window
from bench.metrics import RequestRecord, match_outputs, percentile
from bench.engine_run import EngineSettings, SystemRun, run_ours
from bench.workload import ENGINE_MODEL_DIR, RequestSpec, Workload, ensure_model, make_prompts

NUM_SEQUENTIAL = 8  # the longest prompts, sent one at a time after the burst


def in_process(model_dir: Path, prompts: list[list[int]], workload: Workload, settings: EngineSettings,
               threads: int) -> tuple[SystemRun, list[dict]]:
    """``Engine.generate`` on 1 thread and on ``threads``; the faster run and every row (it first)."""
    rows, runs = [], []
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        run = run_ours(model_dir, prompts, workload, settings)
        if run.error:
            sys.exit(f"in-process engine failed: {run.error}")
        runs.append(run)
        rows.append({"system": f"in-process ({n} thread{'s' if n > 1 else ''})", "seconds": run.seconds,
                     "num_output_tokens": run.num_output_tokens, "output_tokens_per_s": run.output_tokens_per_s})
    # The baseline is the faster in-process run (on a busy machine 1 thread can beat 2).
    best = max(range(len(runs)), key=lambda i: runs[i].output_tokens_per_s)
    rows.insert(0, rows.pop(best))
    return runs[best], rows


def deployment(name: str, pool: DeploymentPool, spec: DeploymentSpec, prompts: list[list[int]],
               output_len: int, reference: SystemRun) -> tuple[dict, list[RequestRecord], list[RequestRecord]]:
    """All prompts at once, then the longest one at a time (2 tokens each): the row, the burst's
    records and the one-at-a-time records. The deployment is stopped afterwards."""
    try:
        address = pool.address(spec)
        with load_window() as load:
            seconds, burst = send_all(address, [RequestSpec(tuple(p), output_len) for p in prompts])
        # Reversed: the same lengths, but prompts the decode worker's prefix cache does not
        # hold from the burst (it would otherwise receive only their last block).
        longest = [p[::-1] for p in sorted(prompts, key=len)[-NUM_SEQUENTIAL:]]
        _, alone = send_all(address, [RequestSpec(tuple(p), 2) for p in longest], concurrency=1)
    finally:
        pool.release(spec)
    num_tokens = sum(r.num_output_tokens for r in burst)
    match = match_outputs([r.token_ids for r in burst], reference.output_ids)
    row = {"system": name, "seconds": seconds, "num_output_tokens": num_tokens,
           "output_tokens_per_s": num_tokens / seconds, "greedy_match": match.fraction,
           "deployment": spec.describe(), "load_average_1m": load}
    return row, burst, alone


def transfer_stats(records: list[RequestRecord]) -> dict:
    """Per-request KV hand-off (``transfer_us``) and wire time of the remotely prefilled requests."""
    timings = [r.server for r in records if r.server is not None and r.server.transfer_bytes]
    if not timings:
        raise RuntimeError("no request moved KV pages (was every prompt prefilled locally?)")
    return {
        "num_transfers": len(timings),
        "payload_bytes_p50": statistics.median(t.transfer_bytes for t in timings),
        "latency_ms_p50": percentile([t.transfer_us / 1e3 for t in timings], 50),
        "latency_ms_p99": percentile([t.transfer_us / 1e3 for t in timings], 99),
        "handoff_gbps_p50": statistics.median(t.transfer_bytes / (t.transfer_us * 1e3) for t in timings),
        "wire_gbps_p50": statistics.median(t.transfer_bytes / (max(t.transfer_wire_us, 1) * 1e3) for t in timings),
    }


def raw_gloo_gbps(payload_bytes: int, out: Path) -> float:
    from bench import kv_transfer

    results = kv_transfer.main(["--sizes-mib", f"{payload_bytes / (1 << 20):.6f}", "--trials", "5",
                                "--min-trial-mib", "32", "--out", str(out)])
    methods = next(iter(results.values()))["methods"]
    return max(methods["raw"]["median_gbps"], methods["raw_pre"]["median_gbps"])


def markdown(systems: list[dict], burst: dict, alone: dict) -> str:
    lines = ["| system | output tok/s | vs in-process | greedy = in-process |", "|---|---|---|---|"]
    for s in systems:
        match = s.get("greedy_match", "reference")
        lines.append(f"| {s['system']} | {s['output_tokens_per_s']:.1f} | {s['vs_in_process']:.2f}× | {match} |")
    lines += ["", "| KV transfer | all requests at once | one at a time |", "|---|---|---|"]
    rows = [("transfers", "num_transfers", "{:.0f}"), ("payload P50 (KiB)", "payload_bytes_p50", "{:.0f}"),
            ("hand-off latency P50 (ms)", "latency_ms_p50", "{:.2f}"),
            ("hand-off latency P99 (ms)", "latency_ms_p99", "{:.2f}"),
            ("hand-off GB/s (bytes / latency), P50", "handoff_gbps_p50", "{:.3f}"),
            ("wire GB/s (bytes / send time), P50", "wire_gbps_p50", "{:.3f}")]
    for label, key, fmt in rows:
        scale = 1 / 1024 if key == "payload_bytes_p50" else 1
        lines.append(f"| {label} | {fmt.format(burst[key] * scale)} | {fmt.format(alone[key] * scale)} |")
    lines += [f"| raw Gloo send of the same payload, GB/s | | {alone['raw_gloo_gbps_same_payload']:.3f} |",
              f"| hand-off / raw Gloo | | {alone['handoff_vs_raw_gloo']:.2f}× |",
              f"| wire / raw Gloo | | {alone['wire_vs_raw_gloo']:.2f}× |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the in-process engine")
    parser.add_argument("--out", type=Path, default=Path("bench/results/disagg.json"))
    args = parser.parse_args(argv)
    workload = Workload(num_requests=args.num_requests, output_len=args.output_len)
    model_dir = ensure_model(ENGINE_MODEL_DIR, workload.model, workload.seed)
    prompts = make_prompts(workload)
    settings = EngineSettings.for_workload(workload)
    flags = engine_flags(settings)
    full = report.header("disagg", args.threads)
    with load_window() as load, tempfile.TemporaryDirectory() as tmp:
        reference, systems = in_process(model_dir, prompts, workload, settings, args.threads)
        pool = DeploymentPool(Path(tmp))
        specs = {"disaggregated": DeploymentSpec(str(model_dir), "disaggregated", worker_flags=flags),
                 "colocated": DeploymentSpec(str(model_dir), "colocated", colocated_threads=1, worker_flags=flags)}
        runs = {name: deployment(name, pool, spec, prompts, workload.output_len, reference)
                for name, spec in specs.items()}
        systems += [row for row, _, _ in runs.values()]
        burst, alone = transfer_stats(runs["disaggregated"][1]), transfer_stats(runs["disaggregated"][2])
        raw = raw_gloo_gbps(int(alone["payload_bytes_p50"]), Path(tmp) / "raw.json")
    for s in systems:
        s["vs_in_process"] = s["output_tokens_per_s"] / systems[0]["output_tokens_per_s"]
    alone.update(raw_gloo_gbps_same_payload=raw, handoff_vs_raw_gloo=alone["handoff_gbps_p50"] / raw,
                 wire_vs_raw_gloo=alone["wire_gbps_p50"] / raw)
    table = markdown(systems, burst, alone)
    sys.stdout.write(table + "\n")
    report.write_json({**full, "workload": workload.to_dict(), "settings": vars(settings), "load_average_1m": load,
                       "systems": systems, "transfer": {"burst": burst, "one_at_a_time": alone},
                       "table_markdown": table}, args.out)


if __name__ == "__main__":
    main()
