"""How the gateway routes (``gateway/routing.py``): its config and flags, kept beside
``plumbing/config.py``, which re-exports them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from plumbing.flags import add_flag

ROUTING_POLICIES = ("load", "prefix")


@dataclass(frozen=True)
class RoutingConfig:
    """How the gateway picks workers (``gateway/routing.py``; docs/architecture.md,
    "KV-aware routing"). ``load``: decode by KV pressure, prefill by queued prompt tokens.
    ``prefix``: the same loads, plus what each worker's prefix cache already holds of the
    prompt (from the workers' KV events), unless the loads are too far apart."""

    policy: str = "prefix"
    # Prefill leg, in prompt tokens: cost = prefill_overlap_weight * uncached prompt tokens
    # + queued prompt tokens (reported + routed). 1.0 makes the cost the tokens the worker
    # computes before this request's first token.
    prefill_overlap_weight: float = 1.0
    # Decode leg: cost = KV pressure (used share of the pool + routed in flight / 64)
    # + decode_overlap_weight * uncached share of the prompt (0 .. 1).
    decode_overlap_weight: float = 1.0
    # Imbalance guards: when the candidates' loads differ by more than this (queued prompt
    # tokens; KV pressure), the leg is picked by load alone.
    prefill_imbalance_tokens: int = 4096
    decode_imbalance: float = 0.25
    # A decode worker predicted to hold at least this share of a prompt prefills it itself
    # (only the uncached rest is computed, nothing is shipped); 1 turns this off.
    local_prefill_min_cached_fraction: float = 0.5
    # Conditional disaggregation: while every live prefill worker has at least this many
    # prompt tokens queued (reported + routed), a decode worker whose own queue, this
    # prompt's uncached part included, is no longer than the shortest of theirs prefills the
    # prompt itself; 0 turns this off.
    local_prefill_spill_tokens: int = 1024
    # What the gateway asks of the workers' KV events (RegisterWorkerResponse).
    kv_events_max_per_beat: int = 4096
    kv_events_interval_ms: int = 50

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        for name in ("prefill_overlap_weight", "decode_overlap_weight", "decode_imbalance"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_imbalance_tokens < 0:
            raise ValueError(f"prefill_imbalance_tokens must be >= 0, got {self.prefill_imbalance_tokens}")
        if not 0 < self.local_prefill_min_cached_fraction <= 1:
            raise ValueError("local_prefill_min_cached_fraction must be in (0, 1], "
                             f"got {self.local_prefill_min_cached_fraction}")
        if self.local_prefill_spill_tokens < 0:
            raise ValueError(f"local_prefill_spill_tokens must be >= 0, got {self.local_prefill_spill_tokens}")
        if not 1 <= self.kv_events_max_per_beat <= 65536:
            raise ValueError(f"kv_events_max_per_beat must be in [1, 65536], got {self.kv_events_max_per_beat}")
        if self.kv_events_interval_ms < 1:
            raise ValueError(f"kv_events_interval_ms must be >= 1, got {self.kv_events_interval_ms}")

    @property
    def wants_kv_events(self) -> bool:
        return self.policy == "prefix"


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    d = RoutingConfig()
    add_flag(p, "--routing", default=d.policy, choices=list(ROUTING_POLICIES),
             help="load: by load alone; prefix: also by what each worker's prefix cache holds (KV events)")
    add_flag(p, "--routing-prefill-overlap-weight", type=float, default=d.prefill_overlap_weight,
             help="prefill cost = weight * uncached prompt tokens + queued prompt tokens")
    add_flag(p, "--routing-decode-overlap-weight", type=float, default=d.decode_overlap_weight,
             help="decode cost = KV pressure + weight * uncached share of the prompt")
    add_flag(p, "--routing-prefill-imbalance-tokens", type=int, default=d.prefill_imbalance_tokens,
             help="prefill workers' queues further apart than this: route by load alone")
    add_flag(p, "--routing-decode-imbalance", type=float, default=d.decode_imbalance,
             help="decode workers' KV pressures further apart than this: route by load alone")
    add_flag(p, "--local-prefill-min-cached-fraction", type=float, default=d.local_prefill_min_cached_fraction,
             help="prefix routing: a decode worker holding this share of the prompt prefills it itself (1: never)")
    add_flag(p, "--local-prefill-spill-tokens", type=int, default=d.local_prefill_spill_tokens,
             help="every prefill worker has this many prompt tokens queued: a decode worker with a shorter "
                  "queue prefills the prompt itself (0: never)")
    add_flag(p, "--kv-events-max-per-beat", type=int, default=d.kv_events_max_per_beat,
             help="most prefix-cache changes a worker sends per heartbeat")
    add_flag(p, "--kv-events-interval-ms", type=int, default=d.kv_events_interval_ms,
             help="workers heartbeat this soon after their prefix cache changed")


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(
        policy=args.routing, prefill_overlap_weight=args.routing_prefill_overlap_weight,
        decode_overlap_weight=args.routing_decode_overlap_weight,
        prefill_imbalance_tokens=args.routing_prefill_imbalance_tokens,
        decode_imbalance=args.routing_decode_imbalance,
        local_prefill_min_cached_fraction=args.local_prefill_min_cached_fraction,
        local_prefill_spill_tokens=args.local_prefill_spill_tokens,
        kv_events_max_per_beat=args.kv_events_max_per_beat, kv_events_interval_ms=args.kv_events_interval_ms,
    )
