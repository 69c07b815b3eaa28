"""Chaos profiles: how much load, which faults, how long to wait for what.

``small`` (CI, a few minutes on 2 cores): every fault type once. ``large`` (the harness):
every fault type once, then faults drawn from the seed up to ``num_faults``. ``replicas``:
``small`` against 3 gateway replicas with resuming clients (``--num-gateways`` sets any
profile's). The fault plan
is a function of the seed alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.chaos.faults import PHASES, Fault

ROLES = ("gateway", "prefill", "decode")


@dataclass(frozen=True)
class ChaosProfile:
    name: str
    min_requests: int  # the faulted phase sends at least this many (and runs until the plan is done)
    baseline_requests: int  # measured no-fault requests before it (after a warm-up pass over the workload)
    num_faults: int  # >= the number of fault types
    num_distinct: int = 150  # the load cycles through this many distinct requests (golden replies to compute)
    migration_kills: int = 0  # a phase of kill -9 of decode workers mid-decode only (0: none)
    concurrency: int = 6
    max_new_tokens: int = 32
    deadline_s: float = 60.0  # per request
    gap_s: float = 1.0  # between faults
    catch_s: float = 5.0  # wait this long for a fault's phase
    restart_delay_s: float = 0.5  # a killed process is started again after this
    worker_pause_s: float = 2.0  # SIGSTOP of a worker: longer than heartbeat period x misses (1.5 s)
    gateway_pause_s: float = 1.0
    heartbeat_period_ms: int = 500
    drain_timeout_s: float = 30.0  # after the load: wait for every pool to be free
    # Gateway replicas (every worker registers with each); with more than one, the load goes
    # round-robin over all of them and a broken stream resumes on another (plumbing/resume.py).
    num_gateways: int = 1
    resume: bool = False  # the load continues broken streams (GenerateRequest.resume)

    def __post_init__(self) -> None:
        if self.num_faults < len(fault_types(self)):
            raise ValueError(f"num_faults must be >= {len(fault_types(self))} (every fault type once)")
        for name in ("min_requests", "baseline_requests", "concurrency", "max_new_tokens", "num_gateways"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def plan(self, seed: int) -> list[Fault]:
        """Every fault type once, then random ones, in an order drawn from ``seed``."""
        rng = random.Random(f"{seed}:plan")
        types = fault_types(self)
        faults = types + [rng.choice(types) for _ in range(self.num_faults - len(types))]
        rng.shuffle(faults)
        return faults


def fault_types(profile: ChaosProfile) -> list[Fault]:
    stops = [Fault("sigstop", role, "decode", profile.gateway_pause_s if role == "gateway" else profile.worker_pause_s)
             for role in ROLES]
    return stops + [Fault("kill", role, phase) for role in ROLES for phase in PHASES]


SMALL = ChaosProfile("small", min_requests=200, baseline_requests=40, num_faults=15, num_distinct=120,
                     concurrency=4, max_new_tokens=32)
LARGE = ChaosProfile("large", min_requests=1000, baseline_requests=300, num_faults=45, num_distinct=1000,
                     concurrency=8, max_new_tokens=48, gap_s=2.0, migration_kills=6)
# The small profile against 3 gateway replicas, the load resuming broken streams.
REPLICAS = ChaosProfile("replicas", min_requests=200, baseline_requests=40, num_faults=15, num_distinct=120,
                        concurrency=4, max_new_tokens=32, num_gateways=3, resume=True)
PROFILES = {p.name: p for p in (SMALL, LARGE, REPLICAS)}
