"""A gateway replica started cold, against one gateway: does it route to the prefix caches as
well? (``python -m bench.routing --replicas``; issue 21.)

The same deployment (``--prefill-workers`` + ``--decode-workers``, ``--routing prefix``) runs
twice, with one gateway and then with two. Each run: the first half of the conversations
through gateway 0 (the workers' prefix caches fill; the second gateway, when there is one,
follows through the workers' KV events), then the second gateway is killed (-9) and started
again: a cold process, knowing nothing, that learns every worker and its whole cache from the
registrations that follow. At once the second half of the conversations runs, each turn on
the gateways in turn (turn t of chat c on gateway (c + t) mod N), so half of them reach the
cold replica. The figure: the prefix-hit ratio (prompt tokens served from a prefix cache /
prompt tokens sent, as the workers report them) of the second half, two replicas against
one. Goal: ≥ 0.9×.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from bench.deployment import WARMUP, engine_flags
from bench.loadgen import LoadGenerator
from bench.machine import load_window
from bench.metrics import RequestRecord
from bench.engine_run import EngineSettings
from bench.workload import Conversation, RequestSpec

GOAL = 0.9


async def _chat(gens: list[LoadGenerator], conv: Conversation, slots: asyncio.Semaphore) -> list[RequestRecord]:
    """One conversation turn after turn, turn t on gateway (c + t) mod N."""
    records: list[RequestRecord] = []
    async with slots:
        for turn, max_tokens in enumerate(conv.answer_lens):
            prompt = conv.prompt(turn, [list(r.token_ids) for r in records])
            gen = gens[(conv.index + turn) % len(gens)]
            record = await gen.send(conv.index * len(conv.answer_lens) + turn,
                                    RequestSpec(prompt, max_tokens, f"turn-{turn}"))
            records.append(record)
            if record.error is not None:
                raise RuntimeError(f"chat {conv.index} turn {turn}: {record.error}")
    return records


async def _run(addresses: list[str], convs: list[Conversation], concurrency: int) -> list[RequestRecord]:
    async with contextlib.AsyncExitStack() as stack:
        gens = [await stack.enter_async_context(LoadGenerator(a, keep_token_ids=True)) for a in addresses]
        for gen in gens:
            await gen.closed_loop([WARMUP], 1)  # untimed: channels, first forwards
        slots = asyncio.Semaphore(concurrency)
        chats = await asyncio.gather(*(_chat(gens, conv, slots) for conv in convs))
    return [r for chat in chats for r in chat]


def hit_ratio(records: list[RequestRecord]) -> float:
    sent = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.server.num_cached_prompt_tokens for r in records if r.server is not None)
    return cached / sent if sent else 0.0


def run_replicas(num_gateways: int, model: str, convs: list[Conversation], args: argparse.Namespace,
                 settings: EngineSettings, log_dir: Path) -> dict:
    """Warm half through gateway 0, the last replica restarted cold, the other half over all."""
    from splitserve.client import wait_for_workers
    from splitserve.cluster import Cluster

    half = len(convs) // 2
    cluster = Cluster(model, num_prefill=args.prefill_workers, num_decode=args.decode_workers, threads=1,
                      num_gateways=num_gateways, gateway_flags=["--routing", "prefix"],
                      worker_flags=list(engine_flags(settings)), log_dir=str(log_dir), log_level="info")
    try:
        cluster.start(timeout_s=600)
        asyncio.run(_run([cluster.addresses["gateway"]], convs[:half], args.concurrency or half))
        cold_s = 0.0
        if num_gateways > 1:
            cold = cluster.gateway_names[-1]
            cluster.kill(cold)
            address = cluster.restart(cold, timeout_s=600)
            started = time.monotonic()
            wait_for_workers(address, args.prefill_workers, args.decode_workers, 120)
            cold_s = time.monotonic() - started
        with load_window() as load:
            records = asyncio.run(_run(cluster.gateway_addresses, convs[half:], args.concurrency or half))
    finally:
        cluster.stop()
    return {"gateways": num_gateways, "requests": len(records), "prompt_tokens": sum(r.num_prompt_tokens for r in records),
            "hit_ratio": hit_ratio(records), "cold_replica_saw_every_worker_s": round(cold_s, 3),
            "load_average_1m": load}


def measure(model: str, convs: list[Conversation], args: argparse.Namespace, settings: EngineSettings,
            log_root: Path) -> dict:
    """One gateway, then two (the second cold); the ratio of their hit ratios and the goal."""
    runs = [run_replicas(n, model, convs, args, settings, log_root / f"{n}-gateways") for n in (1, 2)]
    for run in runs:
        sys.stderr.write(f"routing bench: {run['gateways']} gateway(s): hit ratio {run['hit_ratio']:.3f}\n")
    ratio = runs[1]["hit_ratio"] / runs[0]["hit_ratio"] if runs[0]["hit_ratio"] else None
    return {"runs": runs, "two_over_one": ratio, "goal": f">= {GOAL}",
            "met": ratio is not None and ratio >= GOAL}
