"""Which workers run a request's legs: by load, or by load and prefix-cache affinity.

``--routing load`` picks the decode worker with the lowest KV pressure and the prefill
worker with the fewest queued prompt tokens. ``--routing prefix`` (the default) also counts
what each worker's prefix cache already holds of the prompt, as the gateway's per-worker
index (``gateway/prefix_index.py``, fed by the workers' KV events) predicts it::

    prefill leg:  cost = prefill_overlap_weight × uncached prompt tokens + queued prompt tokens
    decode leg:   cost = KV pressure + decode_overlap_weight × uncached share of the prompt
    either leg:   loads further apart than the imbalance bound ──▶ the least-loaded worker
    then:         the decode worker prefills locally when its uncached rest is shorter than
                  local_prefill_max_tokens, or it holds ≥ local_prefill_min_cached_fraction
                  of the prompt (nothing is shipped, only the rest is computed), or the
                  prefill pool is backed up (spill, below); never with
                  local_prefill_max_tokens 0 (disaggregation forced) while a prefill worker lives

Spill (conditional disaggregation, as Dynamo's disaggregated router does it): while every
live prefill worker has at least ``local_prefill_spill_tokens`` prompt tokens queued, a
decode worker whose own queue, this prompt's uncached part included, is no longer than the
shortest of theirs computes the prompt itself. Under a burst the prefill pool is the
bottleneck and the decode workers' spare steps go unused; spilling starts the prompt where
it starts sooner, and a pool that keeps up is never spilled from.

With weight 1 the prefill cost is the number of prompt tokens the worker computes before this
request's first token (its queue, then the part of this prompt it does not hold): the
cheapest worker is the one expected to answer first, and a long shared prefix outweighs a
short queue. The decode cost adds a share in [0, 1] to the pressure (a fraction of the pool
plus in-flight requests / 64), so a worker holding the whole conversation wins until it is
``decode_imbalance`` fuller than the emptiest one; the guard then routes by load alone.

Candidates are the registry's live workers (registered, heartbeating, SERVING) minus those
that failed this request: cache affinity only ranks them, so a dead, dropped or draining
worker is never picked because of what it holds. Predictions are advice: the worker's own
prefix cache decides what hits, and ``observe`` counts predicted against reported hits
(``splitserve_routing_*``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.prefix_index import prompt_hashes
from gateway.workers import WorkerEntry
from plumbing.config import RoutingConfig
from plumbing.metrics import RoutingMetrics
from splitserve_api.v1 import common_pb2


REASON_PREFIX = "prefix"  # the chosen worker holds part of the prompt
REASON_LOAD = "load"  # load alone decided (policy load, or nobody holds any of it)
REASON_IMBALANCE = "imbalance"  # the loads were too far apart: the guard picked by load
LEG_PREFILL, LEG_LOCAL = "prefill", "local"  # who computed the prompt (observe)
# Why a decode worker computes a prompt itself (prefill_locally).
LOCAL_NO_PREFILL_WORKER, LOCAL_SHORT, LOCAL_CACHED, LOCAL_SPILL = "no_prefill_worker", "short", "cached", "spill"


class Routable(Protocol):
    """What routing needs of a request (``gateway/request.py``'s ``GatewayRequest``)."""

    excluded: set[int]  # workers that failed this request
    block_hashes: dict[tuple[int, int], list[bytes]]  # block hashes by (block size, prompt length): a cache

    @property
    def attempt_prompt(self) -> list[int]:
        """What this attempt prefills: the prompt, plus the tokens sent when it migrates."""


@dataclass(frozen=True)
class Pick:
    """A chosen worker and the prefix-cache hit the gateway predicts there."""

    worker: WorkerEntry
    num_hit_blocks: int
    reason: str

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.worker.prefix.block_size


class Router:
    """Owned by the registry; reads its live workers (``live(role)``) and their prefix indexes."""

    def __init__(self, live: Callable[[int], list[WorkerEntry]], config: RoutingConfig,
                 metrics: RoutingMetrics | None = None) -> None:
        self._live = live
        self.config = config
        self._metrics = metrics

    def _candidates(self, role: int, req: Routable) -> list[WorkerEntry]:
        return [w for w in self._live(role) if w.worker_id not in req.excluded]

    def num_hit_blocks(self, worker: WorkerEntry, req: Routable) -> int:
        """Leading blocks of the prompt the worker's prefix cache holds, as last reported."""
        index = worker.prefix
        if not self.config.wants_kv_events or index.block_size < 1 or not len(index):
            return 0
        return index.num_hit_blocks(prompt_hashes(req.attempt_prompt, index.block_size, req.block_hashes))

    def pick_decode(self, req: Routable) -> Pick | None:
        """The decode worker for ``req`` (None when no live one is left to try)."""
        num_tokens = len(req.attempt_prompt)
        weight = self.config.decode_overlap_weight

        def cost(w: WorkerEntry, hit_blocks: int) -> float:
            return w.kv_pressure() + weight * (1.0 - hit_blocks * w.prefix.block_size / num_tokens)

        return self._pick("decode", self._candidates(common_pb2.WORKER_ROLE_DECODE, req), req,
                          lambda w: w.kv_pressure(), self.config.decode_imbalance, cost)

    def pick_prefill(self, req: Routable) -> Pick | None:
        """The prefill worker for ``req`` (None when no live one is left to try)."""
        num_tokens = len(req.attempt_prompt)
        weight = self.config.prefill_overlap_weight

        def cost(w: WorkerEntry, hit_blocks: int) -> float:
            return weight * (num_tokens - hit_blocks * w.prefix.block_size) + queued_prefill_tokens(w)

        return self._pick("prefill", self._candidates(common_pb2.WORKER_ROLE_PREFILL, req), req,
                          queued_prefill_tokens, self.config.prefill_imbalance_tokens, cost)

    def _pick(self, leg: str, candidates: list[WorkerEntry], req: Routable, load: Callable[[WorkerEntry], float],
              max_spread: float, cost: Callable[[WorkerEntry, int], float]) -> Pick | None:
        if not candidates:
            return None
        loads = {w.worker_id: load(w) for w in candidates}
        by_load = min(candidates, key=lambda w: (loads[w.worker_id], w.worker_id))
        if not self.config.wants_kv_events:
            return self._decided(leg, Pick(by_load, 0, REASON_LOAD))
        hits = {w.worker_id: self.num_hit_blocks(w, req) for w in candidates}
        if max(loads.values()) - min(loads.values()) > max_spread:
            return self._decided(leg, Pick(by_load, hits[by_load.worker_id], REASON_IMBALANCE))
        best = min(candidates, key=lambda w: (cost(w, hits[w.worker_id]), loads[w.worker_id], w.worker_id))
        num_hits = hits[best.worker_id]
        return self._decided(leg, Pick(best, num_hits, REASON_PREFIX if num_hits else REASON_LOAD))

    def _decided(self, leg: str, pick: Pick) -> Pick:
        if self._metrics is not None:
            self._metrics.decisions.labels(leg=leg, reason=pick.reason).inc()
        return pick

    def prefill_locally(self, req: Routable, decode: Pick, local_prefill_max_tokens: int,
                        pending_prefill_tokens: int = 0) -> bool:
        """Whether the decode worker computes the prompt itself: no prefill worker is left,
        or its uncached rest is shorter than ``local_prefill_max_tokens``, or (prefix routing)
        it holds most of the prompt, or the prefill pool is backed up (spill, in the module's
        docstring). ``local_prefill_max_tokens`` 0 forces disaggregation: every prompt goes to
        a prefill worker while one is alive. ``pending_prefill_tokens``: tokens bound for the
        pool but not yet charged to a worker (admission tickets), spread over its workers: a
        burst routed in one turn of the event loop sees its own earlier prompts."""
        prefill = self._candidates(common_pb2.WORKER_ROLE_PREFILL, req)
        if not prefill:
            return self._local(LOCAL_NO_PREFILL_WORKER)
        if local_prefill_max_tokens == 0:
            return False
        num_tokens = len(req.attempt_prompt)
        cached = decode.num_hit_tokens
        if num_tokens - cached < local_prefill_max_tokens:
            return self._local(LOCAL_SHORT)
        if cached > 0 and cached >= self.config.local_prefill_min_cached_fraction * num_tokens:
            return self._local(LOCAL_CACHED)
        spill = self.config.local_prefill_spill_tokens
        shortest = min(queued_prefill_tokens(w) for w in prefill) + pending_prefill_tokens / len(prefill)
        if spill and shortest >= spill and queued_prefill_tokens(decode.worker) + num_tokens - cached <= shortest:
            return self._local(LOCAL_SPILL)
        return False

    def _local(self, reason: str) -> bool:
        if self._metrics is not None:
            self._metrics.local_prefills.labels(reason=reason).inc()
        return True

    def observe(self, leg: str, pick: Pick, num_cached_tokens: int) -> None:
        """Count the hit the worker reported (``num_cached_tokens``) against the prediction."""
        if self._metrics is None or not self.config.wants_kv_events or pick.worker.prefix.block_size < 1:
            return
        actual = num_cached_tokens // pick.worker.prefix.block_size
        self._metrics.predicted_hit_blocks.labels(leg=leg).inc(pick.num_hit_blocks)
        self._metrics.hit_blocks.labels(leg=leg).inc(actual)
        if actual != pick.num_hit_blocks:
            direction = "over" if pick.num_hit_blocks > actual else "under"
            self._metrics.mispredicted.labels(leg=leg, direction=direction).inc()


def queued_prefill_tokens(worker: WorkerEntry) -> int:
    """Prompt tokens ahead of a new request on a worker: reported + routed since (prefill
    legs on a prefill worker, local prefills on a decode worker)."""
    return worker.load.num_queued_prefill_tokens + worker.num_routed_prefill_tokens
