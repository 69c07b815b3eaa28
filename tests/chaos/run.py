"""One chaos run: a 2-prefill + 2-decode cluster, a no-fault phase, then the same workload
under the fault plan; drain, count leaked blocks, stop; compare every OK reply with its golden
reply; summarize (``tests/chaos/report.py``)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from tests.chaos.faults import Fault, FaultRecord, inject
from tests.chaos.load import Outcome, drive
from tests.chaos.procs import ChaosCluster
from tests.chaos.profile import ChaosProfile
from tests.chaos.report import summarize
from tests.chaos.workload import RequestSpec, corpus_token_ids, draw_spec, golden_replies

log = structlog.get_logger()
REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO / "models" / "target")


def make_cluster(model: str, profile: ChaosProfile, log_dir: str | None) -> ChaosCluster:
    return ChaosCluster(
        model, num_prefill=2, num_decode=2, log_dir=log_dir, num_gateways=profile.num_gateways,
        gateway_flags=["--heartbeat-period-ms", str(profile.heartbeat_period_ms)],
    )


def spec_stream(seed: int, tokenizer: object, profile: ChaosProfile) -> Iterator[RequestSpec]:
    """Requests 0, 1, ... of the seed's workload, cycling through ``num_distinct`` of them."""
    corpus = corpus_token_ids(tokenizer)
    specs = [draw_spec(seed, i, corpus, tokenizer, profile.max_new_tokens) for i in range(profile.num_distinct)]
    return itertools.cycle(specs)


async def _watch_crashes(cluster: ChaosCluster, stop: asyncio.Event) -> None:
    """Record processes that exit unbidden, and start them again so the run goes on."""
    while not stop.is_set():
        for name in cluster.check_crashes():
            log.error("chaos.crash", process=name)
            try:
                await cluster.restart_async(name)
            except (RuntimeError, TimeoutError) as exc:
                log.error("chaos.restart_failed", process=name, error=str(exc))
        await asyncio.sleep(0.2)


async def drain(cluster: ChaosCluster, timeout_s: float) -> dict[str, dict[str, int]]:
    """Wait until every worker's pool is free (or the timeout); the last loads seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {n: await cluster.stats(n) for n in cluster.workers()}
        view = {n: {"total": l.kv_blocks_total, "free": l.kv_blocks_free, "in_transfer": l.kv_blocks_in_transfer,
                    "running": l.num_running, "waiting": l.num_waiting} if l is not None else {"unreachable": 1}
                for n, l in loads.items()}
        idle = all(l is not None and l.kv_blocks_free == l.kv_blocks_total and not l.kv_blocks_in_transfer
                   and not l.num_running and not l.num_waiting for l in loads.values())
        if idle or time.monotonic() > deadline:
            return view
        await asyncio.sleep(0.2)


async def _phases(cluster: ChaosCluster, profile: ChaosProfile, seed: int, tokenizer: object,
                  outcomes: list[Outcome], records: list[FaultRecord]) -> dict[str, dict[str, int]]:
    """warm-up (every distinct request once, so prefix caches are as warm as later) ->
    baseline (no fault) -> migration (decode workers killed mid-decode, when the profile has
    it) -> chaos (the fault plan); then the drain."""
    address = ",".join(cluster.gateway_addresses)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_crashes(cluster, stop))
    specs = spec_stream(seed, tokenizer, profile)
    await drive(address, specs, profile.concurrency, profile.deadline_s, "warmup",
                lambda n: n < profile.num_distinct, outcomes, profile.resume)
    await drive(address, specs, profile.concurrency, profile.deadline_s, "baseline",
                lambda n: n < profile.baseline_requests, outcomes, profile.resume)
    plans = [("migration", [Fault("kill", "decode", "decode")] * profile.migration_kills, 0),
             ("chaos", profile.plan(seed), profile.min_requests)]
    for phase, plan, min_requests in plans:
        if not plan:
            continue
        injector = asyncio.create_task(inject(cluster, plan, seed, profile.gap_s, profile.catch_s,
                                              profile.restart_delay_s, records, phase))
        await drive(address, specs, profile.concurrency, profile.deadline_s, phase,
                    lambda n: not injector.done() or n < min_requests, outcomes,  # noqa: B023 - awaited here
                    profile.resume)
        await injector
    loads = await drain(cluster, profile.drain_timeout_s)
    stop.set()
    await watcher
    await cluster.close_channels()
    return loads


def run_chaos(profile: ChaosProfile, seed: int, model: str = DEFAULT_MODEL, log_dir: str | None = None) -> dict:
    """Run the profile; the report (figures and the zero checks) as a dict."""
    from engine.models.spec import load_tokenizer

    load_start = os.getloadavg()
    t0 = time.monotonic()
    tokenizer = load_tokenizer(model)
    cluster = make_cluster(model, profile, log_dir)
    outcomes: list[Outcome] = []
    records: list[FaultRecord] = []
    cluster.start()
    try:
        loads = asyncio.run(_phases(cluster, profile, seed, tokenizer, outcomes, records))
    finally:
        exit_codes = cluster.stop()
    ok_specs = {o.spec.index: o.spec for o in outcomes if o.code == "OK"}
    golden = golden_replies(model, list(ok_specs.values()), {"heartbeat_period_ms": profile.heartbeat_period_ms})
    return summarize(profile, seed, model, outcomes, records, golden, loads, cluster.crashes, exit_codes,
                     load_start, os.getloadavg(), time.monotonic() - t0)
