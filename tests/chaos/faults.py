"""Faults and the injector that fires them, one after another, while the load runs.

A fault is SIGSTOP (for ``pause_s``, then SIGCONT) or kill -9 (then a restart on the same
address) of one process of a role, fired when the cluster is in a phase, as the workers'
exact loads (GetStats, polled every few ms) show it:

=============== ============================== ======================================= =========================
phase           prefill worker (the target)    decode worker (the target)              gateway (any worker)
=============== ============================== ======================================= =========================
before_prefill  prompts queued, none computing a reservation waits, no pages packed yet a decode reservation waits
prefill         a prompt queued or computing   prefilling a prompt itself (local)      a prefill worker computes
transfer        holding packed pages           a reservation waits for its pages       a prefill worker holds pages
decode          a decode worker is decoding    decoding                                a decode worker decodes
=============== ============================== ======================================= =========================

A phase not seen within ``catch_s`` fires anyway (``caught`` False). After a restart, or after
SIGCONT, the injector measures how long the gateway takes to list the process(es) as SERVING
again (a restarted gateway: every worker re-registered with it; a worker: every gateway
replica lists it). With several gateway replicas a gateway fault hits one of them.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import structlog

from tests.chaos.procs import ChaosCluster
from splitserve_api.v1 import common_pb2

log = structlog.get_logger()
PHASES = ("before_prefill", "prefill", "transfer", "decode")


@dataclass(frozen=True)
class Fault:
    kind: str  # "sigstop" | "kill"
    role: str  # "gateway" | "prefill" | "decode"
    phase: str
    pause_s: float = 0.0  # sigstop only

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.role}:{self.phase}"


@dataclass
class FaultRecord:
    fault: Fault
    target: str
    at: float  # monotonic, when it fired
    caught: bool  # the phase was seen before it fired
    until: float = 0.0  # monotonic, when the target was back (restarted or resumed)
    back_in_routing_s: float | None = None  # from ready (or SIGCONT) to SERVING at the gateway
    error: str = ""
    phase: str = ""  # of the run ("migration", "chaos")


def _busy(load: common_pb2.WorkerLoad | None, phase: str, role: str) -> bool:
    if load is None:
        return False
    if phase == "before_prefill":
        return load.num_waiting > 0 if role == "prefill" else load.kv_blocks_in_transfer > 0
    if phase == "prefill":  # a prompt computing, or queued and not yet computed
        return load.num_queued_prefill_tokens > 0 or (role == "prefill" and load.num_running > 0)
    if phase == "transfer":
        return load.kv_blocks_in_transfer > 0
    return load.num_running > 0 if role == "decode" else False


async def in_phase(cluster: ChaosCluster, target: str, phase: str) -> bool:
    role = target.split("-")[0]
    names = [n for n in cluster.workers() if n not in cluster.expected_exit]
    loads = dict(zip(names, await asyncio.gather(*(cluster.stats(n, 0.5) for n in names))))
    if role == "gateway":
        watch = {"before_prefill": "decode", "prefill": "prefill", "transfer": "prefill", "decode": "decode"}[phase]
        return any(_busy(loads[n], phase, watch) for n in loads if n.startswith(watch))
    if phase == "decode" and role == "prefill":
        return any(_busy(loads[n], "decode", "decode") for n in loads if n.startswith("decode"))
    busy = _busy(loads.get(target), phase, role)
    if busy and phase == "before_prefill" and role == "decode":  # no pages packed anywhere yet
        return not any(loads[n] is not None and loads[n].kv_blocks_in_transfer for n in loads if n.startswith("prefill"))
    return busy


async def wait_phase(cluster: ChaosCluster, target: str, phase: str, catch_s: float) -> bool:
    deadline = time.monotonic() + catch_s
    while time.monotonic() < deadline:
        if await in_phase(cluster, target, phase):
            return True
        await asyncio.sleep(0.005)
    return False


async def fire(cluster: ChaosCluster, fault: Fault, rng: random.Random, catch_s: float,
               restart_delay_s: float) -> FaultRecord:
    """Wait for the phase, fire, bring the target back, measure its return to routing."""
    target = rng.choice(cluster.names(fault.role))
    caught = await wait_phase(cluster, target, fault.phase, catch_s)
    record = FaultRecord(fault, target, time.monotonic(), caught)
    log.info("chaos.fault", fault=fault.name, target=target, caught=caught)
    is_gateway = cluster.role(target) == "gateway"
    back_names = cluster.workers() if is_gateway else [target]
    try:
        if fault.kind == "sigstop":
            cluster.pause(target)
            await asyncio.sleep(fault.pause_s)
            cluster.resume(target)
            record.until = time.monotonic()
        else:
            cluster.kill(target)
            await asyncio.sleep(restart_delay_s)
            record.until = await cluster.restart_async(target)
        back_names = [n for n in back_names if n not in cluster.expected_exit]
        record.back_in_routing_s = await cluster.wait_in_routing(back_names, record.until,
                                                                 gateways=[target] if is_gateway else None)
    except (RuntimeError, TimeoutError) as exc:
        record.error = str(exc)
    return record


async def inject(cluster: ChaosCluster, plan: list[Fault], seed: int, gap_s: float, catch_s: float,
                 restart_delay_s: float, records: list[FaultRecord], phase: str) -> None:
    """Fire ``plan`` in order, ``gap_s`` apart (the load recovers in between)."""
    rng = random.Random(f"{seed}:{phase}:targets")
    for fault in plan:
        await asyncio.sleep(gap_s)
        record = await fire(cluster, fault, rng, catch_s, restart_delay_s)
        record.phase = phase
        records.append(record)
