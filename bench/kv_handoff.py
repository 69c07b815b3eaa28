"""The KV hand-off at low load (issue #13), not a test:

    python -m bench.kv_handoff [--rounds 8] [--out bench/results/kv_handoff.json]

On the engine benchmark's model (``bench/workload.py``: a 32M random Llama, float32), with
one torch thread per worker:

* **Time to first token**: prompts of 256 and 1,024 random tokens, one request at a time,
  alternating between a disaggregated deployment (gateway + prefill + decode, every prompt
  prefilled remotely) and a colocated one (gateway + decode worker, prefilled there), both up
  at once, so both see the same machine. TTFT is the client's: send to the first token.
* **A shared-prefix workload**: a system prompt of 256 tokens (about 1 KiB of text at ~4
  bytes a token) plus questions of 32–128 tokens, one at a time, on the disaggregated
  deployment: the KV bytes shipped per request against the whole prompt's, and the decode
  worker's prefix-cache hits as ``GetStats`` and its Prometheus endpoint report them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc

from bench import report
from bench.deployment import engine_flags
from bench.loadgen import LoadGenerator
from bench.machine import load_window
from bench.metrics import RequestRecord, percentile
from bench.engine_run import EngineSettings
from bench.workload import ENGINE_MODEL_DIR, RequestSpec, Workload, ensure_model

LENGTHS = (256, 1024)
SYSTEM_LEN = 256
OUTPUT_LEN = 4


def _prompts(rng: random.Random, vocab: int, length: int, count: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


async def _alternate(addresses: dict[str, str], prompts: list[list[int]]) -> dict[str, list[RequestRecord]]:
    """Each prompt to every deployment in turn, one request at a time."""
    out: dict[str, list[RequestRecord]] = {name: [] for name in addresses}
    gens = {name: LoadGenerator(address) for name, address in addresses.items()}
    for gen in gens.values():
        await gen.__aenter__()
    try:
        for name, gen in gens.items():  # untimed warm-up: channels, first forwards
            await gen.send(-1, RequestSpec(tuple(reversed(prompts[0][-64:])), OUTPUT_LEN))
        for i, prompt in enumerate(prompts):
            for name, gen in gens.items():
                record = await gen.send(i, RequestSpec(tuple(prompt), OUTPUT_LEN))
                if record.error:
                    raise RuntimeError(f"{name}: {record.error}")
                out[name].append(record)
    finally:
        for gen in gens.values():
            await gen.__aexit__()
    return out


def ttft_rows(addresses: dict[str, str], vocab: int, rounds: int) -> list[dict]:
    rng = random.Random(13)
    rows = []
    for length in LENGTHS:
        with load_window() as load:
            records = asyncio.run(_alternate(addresses, _prompts(rng, vocab, length, rounds)))
        p50 = {name: percentile([r.ttft_s * 1e3 for r in recs], 50) for name, recs in records.items()}
        rows.append({"prompt_tokens": length, "ttft_ms_p50": p50,
                     "ttft_ms_all": {n: [round(r.ttft_s * 1e3, 2) for r in recs] for n, recs in records.items()},
                     "disaggregated_vs_colocated": p50["disaggregated"] / p50["colocated"],
                     "load_average_1m": load})
    return rows


def shared_prefix(address: str, vocab: int, rounds: int, bytes_per_token: float) -> dict:
    rng = random.Random(29)
    system = _prompts(rng, vocab, SYSTEM_LEN, 1)[0]
    prompts = [system + _prompts(rng, vocab, rng.randint(32, 128), 1)[0] for _ in range(rounds)]
    records = asyncio.run(_alternate({"disaggregated": address}, prompts))["disaggregated"]
    shipped = [r.server.transfer_bytes for r in records]
    whole = [_whole_bytes(len(p), bytes_per_token) for p in prompts]
    later = range(1, rounds)  # the first request finds nothing cached
    return {
        "system_prompt_tokens": SYSTEM_LEN, "num_requests": rounds,
        "shipped_bytes": shipped, "whole_prompt_bytes": whole,
        "shipped_fraction_mean_after_first": statistics.mean(shipped[i] / whole[i] for i in later),
        "unshared_fraction_mean_after_first": statistics.mean(1 - (SYSTEM_LEN // 16 * 16) / len(prompts[i])
                                                              for i in later),
        "first_request_shipped_fraction": shipped[0] / whole[0],
    }


def _whole_bytes(num_tokens: int, bytes_per_token: float) -> int:
    return int(-(-num_tokens // 16) * 16 * bytes_per_token)


def decode_counters(gateway: str, metrics_url: str) -> dict:
    """The decode worker's prefix-cache figures: GetStats and its Prometheus text."""
    from plumbing.rpc import channel_options
    from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(gateway, options=channel_options()) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
    worker = next(w for w in info.workers if w.role == common_pb2.WORKER_ROLE_DECODE)
    with grpc.insecure_channel(worker.address, options=channel_options()) as channel:
        load = decode_pb2_grpc.DecodeWorkerStub(channel).GetStats(common_pb2.GetStatsRequest(), timeout=5)
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()  # noqa: S310 - 127.0.0.1
    lines = [line for line in text.splitlines()
             if line.startswith(("splitserve_prefix_cache_hit_tokens_total", "splitserve_kv_received_prompt_tokens_total"))]
    return {"get_stats": {"num_cached_prompt_tokens": load.num_cached_prompt_tokens,
                          "num_received_prompt_tokens": load.num_received_prompt_tokens},
            "prometheus": lines}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> dict:
    from splitserve.cluster import Cluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_handoff.json"))
    args = parser.parse_args(argv)
    workload = Workload(num_requests=16, output_len=OUTPUT_LEN, max_prompt_len=max(LENGTHS) + 64)
    model_dir = ensure_model(ENGINE_MODEL_DIR, workload.model, workload.seed)
    settings = EngineSettings.for_workload(workload)
    flags = list(engine_flags(replace(settings, num_kv_blocks=max(settings.num_kv_blocks, 1024))))
    full = report.header("kv_handoff", 1)
    metrics_port = _free_port()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        disagg = Cluster(str(model_dir), num_prefill=1, num_decode=1, threads=1, worker_flags=flags,
                         gateway_flags=["--local-prefill-max-tokens", "0"], metrics_port=metrics_port,
                         log_dir=f"{tmp}/disagg", log_level="warning")
        colocated = Cluster(str(model_dir), num_prefill=0, num_decode=1, threads=1, worker_flags=flags,
                            log_dir=f"{tmp}/colocated", log_level="warning")
        with disagg, colocated:
            addresses = {"disaggregated": disagg.addresses["gateway"], "colocated": colocated.addresses["gateway"]}
            ttft = ttft_rows(addresses, workload.model.vocab_size, args.rounds)
            m = workload.model
            bytes_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * (m.hidden_size // m.num_attention_heads) * 4
            shared = shared_prefix(addresses["disaggregated"], m.vocab_size, args.rounds * 2, bytes_per_token)
            shared["decode_worker"] = decode_counters(addresses["disaggregated"],
                                                      f"http://127.0.0.1:{metrics_port + 2}/metrics")
    result = {**full, "ttft": ttft, "shared_prefix": shared, "wall_s": time.perf_counter() - start}
    for row in ttft:
        print(f"TTFT P50 {row['prompt_tokens']} tokens: disaggregated {row['ttft_ms_p50']['disaggregated']:.1f} ms, "
              f"colocated {row['ttft_ms_p50']['colocated']:.1f} ms, ratio {row['disaggregated_vs_colocated']:.2f}x "
              f"(load {row['load_average_1m']})")
    print(f"shared prefix: shipped {shared['shipped_fraction_mean_after_first']:.3f} of the whole prompt's bytes "
          f"(unshared fraction {shared['unshared_fraction_mean_after_first']:.3f}); first request "
          f"{shared['first_request_shipped_fraction']:.3f}; decode worker {shared['decode_worker']}")
    report.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
