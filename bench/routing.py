"""KV-aware (prefix) routing against load routing, side by side in one run (not a test).

    python -m bench.routing [--conversations 20] [--turns 8] [--rounds 1] \\
        [--out bench/results/routing.json]

The same deployment, ``--prefill-workers`` + ``--decode-workers`` processes (2 + 2, one
torch thread each) and a gateway, is started once per policy (``--routing load``, then
``--routing prefix``; with ``--rounds 2`` load, prefix, prefix, load, so drift of a shared
machine's load falls on both alike) and runs the same multi-turn chat workload
(``bench.workload.conversations``): ``--conversations`` chats, run by ``--concurrency``
clients (8; 0: every chat at once), each client running its chats one after another and
each chat its turns one after another, every turn resending the whole conversation (its
system prompt, shared with other chats, earlier turns and the model's actual answers).
Greedy, EOS ignored, so every prompt's length is the workload's whatever the model answers.
``--replicas`` measures instead a second gateway replica started cold against one gateway
(``bench/routing_replicas.py``).

Figures per policy: prompt tokens computed (sent − served from a prefix cache, as the
workers report them), KV bytes shipped between workers, TTFT P50/P99 (client side), output
tokens/s and requests/s over the run's window, how many turns were prefilled on their decode
worker, and the gateway's ``splitserve_routing_*`` counters (hit blocks predicted against
reported). Goals (issue 18): prefix routing at ≤ 0.6× load routing's TTFT P50 and ≤ 0.5× its
prompt tokens computed, with throughput no worse.

The default model is a seeded random Llama (``.cache/bench-llama-routing``: hidden 256, 4
layers, 4 heads / 2 KV heads, vocabulary 4096, 4096 positions, float32): the bundled model's
size, with room for 1–4 KiB system prompts (≈ 256–1024 tokens) and eight turns, which its
512 positions do not have. ``--model models/target`` runs the bundled model with workload
flags that fit 512 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import report
from bench.deployment import WARMUP, engine_flags
from bench.loadgen import LoadGenerator
from bench.machine import load_window
from bench.metrics import RequestRecord, match_outputs, percentile, throughput, window_s
from bench.engine_run import EngineSettings
from bench.workload import CACHE_DIR, Conversation, LengthDist, ModelShape, RequestSpec, conversations, ensure_model

POLICIES = ("load", "prefix")
ROUTING_MODEL_DIR = CACHE_DIR / "bench-llama-routing"
ROUTING_MODEL = ModelShape(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=688, vocab_size=4096, max_position_embeddings=4096,
                           initializer_range=0.15)  # wide: greedy answers do not hinge on rounding
BLOCK_SIZE = 16
GOALS = (("ttft_p50", "TTFT P50, prefix / load", 0.6, "<="),
         ("prompt_tokens_computed", "prompt tokens computed, prefix / load", 0.5, "<="),
         ("output_tokens_per_s", "output tokens/s, prefix / load", 1.0, ">="))


# -- one deployment, one policy ---------------------------------------------------------------------

async def _chat(gen: LoadGenerator, conv: Conversation, slots: asyncio.Semaphore) -> list[RequestRecord]:
    """One conversation, turn after turn (a slot held throughout, as a user's session)."""
    records: list[RequestRecord] = []
    async with slots:
        for turn, max_tokens in enumerate(conv.answer_lens):
            prompt = conv.prompt(turn, [list(r.token_ids) for r in records])
            record = await gen.send(conv.index * len(conv.answer_lens) + turn,
                                    RequestSpec(prompt, max_tokens, f"turn-{turn}"))
            records.append(record)
            if record.error is not None:
                break  # its later prompts would need this answer
    return records


async def _run_chats(address: str, convs: list[Conversation], concurrency: int) -> list[RequestRecord]:
    async with LoadGenerator(address, keep_token_ids=True) as gen:
        await gen.closed_loop([WARMUP] * 2, 2)  # untimed: channels, first forwards (one 16-token block)
        slots = asyncio.Semaphore(concurrency)
        chats = await asyncio.gather(*(_chat(gen, conv, slots) for conv in convs))
    return sorted((r for chat in chats for r in chat), key=lambda r: r.index)


def _gateway_metrics_port(log_path: Path) -> int:
    for line in log_path.read_text().splitlines():
        if '"gateway.listening"' in line:
            return int(json.loads(line)["metrics_port"])
    raise RuntimeError(f"no gateway.listening line in {log_path}")


def routing_counters(metrics_port: int) -> dict[str, float]:
    """The gateway's ``splitserve_routing_*`` counters, one key per name and label set."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("splitserve_routing_") and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name.removesuffix('_total')}{{{labels}}}"] = sample.value
    return out


def run_policy(policy: str, model: str, convs: list[Conversation], args: argparse.Namespace,
               settings: EngineSettings, log_dir: Path) -> dict:
    """Start the deployment with ``--routing policy``, run the chats, stop it."""
    from splitserve.cluster import Cluster

    cluster = Cluster(model, num_prefill=args.prefill_workers, num_decode=args.decode_workers, threads=1,
                      gateway_flags=["--routing", policy, "--metrics-port", "0"],
                      worker_flags=list(engine_flags(settings)), log_dir=str(log_dir), log_level="info")
    try:
        address = cluster.start(timeout_s=600)  # a shared, loaded machine can be slow to start four workers
        with load_window() as load:
            records = asyncio.run(_run_chats(address, convs, args.concurrency or len(convs)))
        counters = routing_counters(_gateway_metrics_port(log_dir / "gateway.log"))
    finally:
        cluster.stop()
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{policy}: {len(failed)} request(s) failed: {failed[0]}")
    return {"policy": policy, "records": records, "window_s": window_s(records), "load_average_1m": load,
            "routing_counters": counters}


# -- figures ----------------------------------------------------------------------------------------

def summarize(runs: list[dict]) -> dict:
    """One policy's figures over its rounds (windows add up; percentiles over every request)."""
    records = [r for run in runs for r in run["records"]]
    seconds = sum(run["window_s"] for run in runs)
    servers = [r.server for r in records]
    num_prompt = sum(r.num_prompt_tokens for r in records)
    num_cached = sum(s.num_cached_prompt_tokens for s in servers)
    ttft = [r.ttft_s for r in records]
    later = [r.ttft_s for r in records if r.kind != "turn-0"]
    rate = throughput(records, seconds)
    counters: dict[str, float] = {}
    for run in runs:
        for key, value in run["routing_counters"].items():
            counters[key] = counters.get(key, 0.0) + value
    return {
        "num_requests": len(records), "seconds": seconds,
        "prompt_tokens": num_prompt, "prompt_tokens_cached": num_cached,
        "prompt_tokens_computed": num_prompt - num_cached,
        "kv_bytes_shipped": sum(s.transfer_bytes for s in servers),
        "num_prefilled_on_decode_worker": sum(1 for s in servers if not s.transfer_bytes),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "ttft_p50_later_turns": percentile(later, 50) if later else None,
        "ttft_p99_later_turns": percentile(later, 99) if later else None,
        "output_tokens_per_s": rate.output_tokens_per_s, "requests_per_s": rate.requests_per_s,
        "load_average_1m": [run["load_average_1m"] for run in runs], "routing_counters": counters,
    }


def per_request(run: dict) -> dict[str, list]:
    """One round's requests as columns (conversation × turns + turn order)."""
    records = run["records"]
    return {"index": [r.index for r in records], "kind": [r.kind for r in records],
            "prompt_tokens": [r.num_prompt_tokens for r in records],
            "cached_tokens": [r.server.num_cached_prompt_tokens for r in records],
            "kv_bytes": [r.server.transfer_bytes for r in records],
            "ttft_ms": [round(r.ttft_s * 1e3, 3) for r in records], "e2e_ms": [round(r.e2e_s * 1e3, 3) for r in records]}


def compare(figures: dict[str, dict], answers: dict[str, list[tuple[int, ...]]]) -> dict:
    load, prefix = figures["load"], figures["prefix"]
    ratios = {key: prefix[key] / load[key] for key, _, _, _ in GOALS if load[key]}
    ratios["kv_bytes_shipped"] = prefix["kv_bytes_shipped"] / load["kv_bytes_shipped"] if load["kv_bytes_shipped"] else None
    ratios["ttft_p99"] = prefix["ttft_p99"] / load["ttft_p99"]
    goals = [{"goal": text, "target": f"{op} {target}", "ratio": ratios.get(key),
              "met": ratios.get(key) is not None and (ratios[key] <= target if op == "<=" else ratios[key] >= target)}
             for key, text, target, op in GOALS]
    match = match_outputs(answers["prefix"], answers["load"])
    return {"prefix_over_load": ratios, "goals": goals, "answers_equal": match.to_dict()}


def markdown(figures: dict[str, dict], comparison: dict) -> str:
    rows = [("prompt tokens sent", "prompt_tokens", "{:.0f}"), ("prompt tokens computed", "prompt_tokens_computed", "{:.0f}"),
            ("KV MiB shipped", "kv_bytes_shipped", "{:.1f}"), ("turns prefilled on their decode worker",
                                                              "num_prefilled_on_decode_worker", "{:.0f}"),
            ("TTFT P50 (ms)", "ttft_p50", "{:.1f}"), ("TTFT P99 (ms)", "ttft_p99", "{:.1f}"),
            ("TTFT P50, turns 2+ (ms)", "ttft_p50_later_turns", "{:.1f}"),
            ("TTFT P99, turns 2+ (ms)", "ttft_p99_later_turns", "{:.1f}"),
            ("output tokens/s", "output_tokens_per_s", "{:.1f}"), ("requests/s", "requests_per_s", "{:.2f}")]
    scale = {"kv_bytes_shipped": 1 / (1 << 20), "ttft_p50": 1e3, "ttft_p99": 1e3, "ttft_p50_later_turns": 1e3,
             "ttft_p99_later_turns": 1e3}
    lines = ["| | load | prefix | prefix / load |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        a, b = figures["load"][key], figures["prefix"][key]
        ratio = f"{b / a:.2f}×" if a else "—"
        s = scale.get(key, 1)
        lines.append(f"| {label} | {fmt.format(a * s)} | {fmt.format(b * s)} | {ratio} |")
    lines += ["", "| goal | ratio | met |", "|---|---|---|"]
    for goal in comparison["goals"]:
        ratio = "—" if goal["ratio"] is None else f"{goal['ratio']:.2f}×"
        lines.append(f"| {goal['goal']} {goal['target']} | {ratio} | {'yes' if goal['met'] else 'no'} |")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------

def _dist(text: str) -> LengthDist:
    lo, _, hi = text.partition(":")
    return LengthDist(int(lo), int(hi or lo))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts the chats share")
    p.add_argument("--system-tokens", type=_dist, default=_dist("256:1024"), help="lo:hi (≈ 1–4 KiB of text)")
    p.add_argument("--user-tokens", type=_dist, default=_dist("32:128"), help="lo:hi per user turn")
    p.add_argument("--answer-tokens", type=_dist, default=_dist("16:64"), help="lo:hi per answer")
    p.add_argument("--concurrency", type=int, default=8,
                   help="clients, each running its chats one after another (0: every chat at once)")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="policy runs each: load, prefix (, prefix, load, ...)")
    p.add_argument("--kv-blocks", type=int, default=0, help="per worker (0: room for every chat at its longest)")
    p.add_argument("--model", default=None, help="checkpoint (default: the seeded random routing model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    p.add_argument("--log-dir", type=Path, default=None, help="keep the services' logs here (default: discarded)")
    p.add_argument("--replicas", action="store_true",
                   help="instead: prefix routing's hit ratio with a second gateway started cold, against one "
                        "gateway (bench/routing_replicas.py)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = args.model or str(ensure_model(ROUTING_MODEL_DIR, ROUTING_MODEL, args.seed))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    convs = conversations(args.conversations, args.turns, args.system_prompts, args.seed, vocab,
                          args.system_tokens, args.user_tokens, args.answer_tokens)
    longest = max(c.max_tokens() for c in convs)
    footprint = sum(-(-c.max_tokens() // BLOCK_SIZE) for c in convs)
    settings = EngineSettings(block_size=BLOCK_SIZE, num_kv_blocks=args.kv_blocks or footprint + 256,
                              max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=longest + 1)
    if args.replicas:
        from bench.routing_replicas import measure

        with tempfile.TemporaryDirectory() as tmp:
            result = {**report.header("routing-replicas", 1), **measure(model, convs, args, settings,
                                                                        args.log_dir or Path(tmp))}
        report.write_json(result, args.out)
        return result
    order = [p for i in range(args.rounds) for p in (POLICIES if i % 2 == 0 else POLICIES[::-1])]
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    full = report.header("routing", 1)
    with load_window() as load, tempfile.TemporaryDirectory() as tmp:
        for i, policy in enumerate(order):
            log_dir = (args.log_dir or Path(tmp)) / f"{i}-{policy}"
            runs[policy].append(run_policy(policy, model, convs, args, settings, log_dir))
            sys.stderr.write(f"routing bench: {policy} round done ({len(runs[policy][-1]['records'])} requests)\n")
    figures = {p: summarize(runs[p]) for p in POLICIES}
    requests = {p: [per_request(run) for run in runs[p]] for p in POLICIES}
    answers = {p: [r.token_ids for r in runs[p][0]["records"]] for p in POLICIES}
    comparison = compare(figures, answers)
    table = markdown(figures, comparison)
    sys.stdout.write(table + "\n")
    workload = {"conversations": args.conversations, "turns": args.turns, "system_prompts": args.system_prompts,
                "system_tokens": args.system_tokens.to_dict(), "user_tokens": args.user_tokens.to_dict(),
                "answer_tokens": args.answer_tokens.to_dict(), "concurrency": args.concurrency or args.conversations,
                "seed": args.seed, "model": model, "longest_sequence": longest}
    deployment = {"prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
                  "threads_per_worker": 1, "engine": vars(settings), "order": order}
    result = {**full, "workload": workload, "deployment": deployment, "load_average_1m": load,
              "figures": figures, **comparison, "table_markdown": table, "requests": requests}
    report.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
