"""Fuzz profiles: how many cases of each family (``small`` for CI, ``large`` for the harness)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FuzzProfile:
    name: str
    generate: int  # structured gateway requests (``strategies.generate_request``)
    structured: int  # per RPC: messages from the request type's descriptor
    wire: int  # per RPC: mutated serializations
    raw: int  # per RPC: random bytes
    flood_requests: int  # valid Generate calls at once (past max_in_flight)
    flood_huge_prompts: int  # multi-MB text prompts at once
    flood_garbage: int  # random-bytes calls at once
    registry: int  # RegisterWorker / Heartbeat messages (last: they pollute the registry)
    http: int = 0  # HTTP family: requests to the OpenAI front (``http_cases``)
    http_near_cap: int = 0  # HTTP bodies just under the cap (the gateway tokenizes 4 MB each)
    concurrency: int = 8
    max_in_flight: int = 64  # the gateway's, so the request flood goes past it
    heartbeat_period_ms: int = 500

    @property
    def num_cases(self) -> int:
        from tests.fuzz.methods import GATEWAY, WORKERS

        per_rpc = len(GATEWAY) + len(WORKERS) + 1  # + an unknown method
        return (self.generate + per_rpc * (self.structured + self.wire + self.raw) + self.flood_requests
                + self.flood_huge_prompts + self.flood_garbage + 2 * self.registry + self.http + self.http_near_cap)


SMALL = FuzzProfile("small", generate=60, structured=8, wire=9, raw=4, flood_requests=80, flood_huge_prompts=2,
                    flood_garbage=40, registry=10, http=60)
LARGE = FuzzProfile("large", generate=1500, structured=120, wire=150, raw=60, flood_requests=300,
                    flood_huge_prompts=4, flood_garbage=300, registry=100, http=1200, http_near_cap=2)
PROFILES = {p.name: p for p in (SMALL, LARGE)}
