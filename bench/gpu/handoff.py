"""The ``handoff`` step: a disaggregated 1 + 1 cluster on the one device (``splitserve.cluster``:
a gateway, a prefill worker and a decode worker, three processes), every prompt prefilled
remotely, and the KV hand-off's speed as the workers report it (``PhaseTimings``:
``transfer_bytes`` over ``transfer_us``, and over ``transfer_wire_us``, the send alone).

The pages travel over Gloo through host memory (``--transport gloo``: packed on the GPU,
staged in host memory, TCP on loopback, unpacked on the GPU). NCCL cannot join two ranks on
one GPU, so the NCCL data path needs two devices and is not measured here.

The model has the 8B model's KV shape (32 layers x 8 KV heads x 128, 128 KiB a token in
bfloat16) on a small body, so a 2k-token prompt ships 256 MiB as Llama-3-8B's would while
each worker loads 0.5 GB instead of 16 (tiny in a dry run, on the CPU; bfloat16 in both).
"""

from __future__ import annotations

import random
import statistics
import time

from bench.deployment import send_all
from bench.gpu.models import random_checkpoint
from bench.gpu.options import GpuCheckOptions
from bench.workload import RequestSpec

OUTPUT_LEN = 4
NCCL_NOTE = ("KV over Gloo through host memory: NCCL cannot join two ranks on one GPU, so the NCCL "
             "data path needs two devices and was not measured")


def _worker_flags(options: GpuCheckOptions) -> list[str]:
    p = options.profile
    max_len = p.handoff_prompt_len + OUTPUT_LEN + 16
    blocks = (p.handoff_requests + 4) * -(-max_len // 16)
    return ["--device", "cpu" if options.dry_run else "cuda", "--dtype", "bfloat16",
            "--transport", "gloo", "--num-kv-blocks", str(blocks), "--max-model-len", str(max_len),
            "--block-size", "16", "--max-num-batched-tokens", str(max(2048, p.handoff_prompt_len)),
            "--max-num-seqs", "8"]


def _per_request(records: list) -> list[dict]:
    out = []
    for r in records:
        s = r.server
        row = {"prompt_tokens": r.num_prompt_tokens, "transfer_bytes": s.transfer_bytes,
               "transfer_us": s.transfer_us, "transfer_wire_us": s.transfer_wire_us, "ttft_s": r.ttft_s}
        if s.transfer_bytes and s.transfer_us:
            row["gb_per_s"] = s.transfer_bytes / s.transfer_us / 1e3
        if s.transfer_bytes and s.transfer_wire_us:
            row["wire_gb_per_s"] = s.transfer_bytes / s.transfer_wire_us / 1e3
        out.append(row)
    return out


def handoff_step(options: GpuCheckOptions, deadline: float) -> dict:
    from splitserve.cluster import Cluster

    p = options.profile
    model_dir = random_checkpoint(options.cache_dir / f"handoff-{p.name}", p.handoff_model, options.seed, 0.02)
    rng = random.Random(options.seed)
    prompts = [tuple(rng.randrange(3, p.handoff_model.vocab_size) for _ in range(p.handoff_prompt_len))
               for _ in range(p.handoff_requests)]
    cluster = Cluster(str(model_dir), num_prefill=1, num_decode=1, threads=1 if options.dry_run else 4,
                      gateway_flags=["--local-prefill-max-tokens", "0"], worker_flags=_worker_flags(options),
                      log_dir=str(options.out_dir / "steps" / "handoff-cluster"), log_level="warning")
    try:
        started = time.monotonic()
        address = cluster.start(timeout_s=max(10.0, deadline - time.monotonic()))
        start_s = time.monotonic() - started
        # one at a time: each hand-off alone on the link
        window_s, records = send_all(address, [RequestSpec(pr, OUTPUT_LEN) for pr in prompts], concurrency=1)
    finally:
        exit_codes = cluster.stop()
    rows = _per_request(records)
    timed = [r for r in rows[1:] if "gb_per_s" in r] or [r for r in rows if "gb_per_s" in r]
    return {"transport": "gloo", "note": NCCL_NOTE, "model_kv_bytes_per_token": p.handoff_model.kv_bytes_per_token(2),
            "worker_flags": _worker_flags(options), "cluster_start_s": start_s, "window_s": window_s,
            "requests": rows, "all_prefilled_remotely": all(r["transfer_bytes"] > 0 for r in rows),
            "median_gb_per_s": statistics.median(r["gb_per_s"] for r in timed) if timed else None,
            "median_wire_gb_per_s": statistics.median(r["wire_gb_per_s"] for r in timed if "wire_gb_per_s" in r)
            if any("wire_gb_per_s" in r for r in timed) else None,
            "exit_codes": exit_codes}
