"""Prometheus metrics (``splitserve_*``), one registry per service process.

Each service builds the metrics it owns and serves ``/metrics`` on its own port
(``--metrics-port``; 0 picks a free port, -1 disables the endpoint). Every sample served
carries the process's constant labels too (``model``; a worker's own metrics carry ``role``),
added at scrape time, so the metrics themselves are declared once without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Time to first token and between tokens: CPU decode steps take 2-20 ms, so the buckets are
# about 25% apart from 0.5 ms to 50 ms (the old ones put most of a run in one 5-10 ms bucket).
_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01,
                          0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                          0.75, 1, 2.5, 5, 10, 30)
_BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(0, 10))


class ConstLabels(Collector):
    """``registry``'s metrics with ``labels`` added to every sample that lacks them."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, **{k: v for k, v in self._labels.items() if k not in s.labels}},
                               s.value, s.timestamp, s.exemplar)
            yield out


def serve_metrics(registry: CollectorRegistry, host: str, port: int, labels: dict[str, str]) -> int | None:
    """Start the /metrics endpoint, every sample labelled with ``labels`` as well (``model``);
    returns the bound port (None when disabled)."""
    if port < 0:
        return None
    served = CollectorRegistry(auto_describe=False)
    served.register(ConstLabels(registry, labels))
    server, _thread = start_http_server(port, addr=host, registry=served)
    return int(server.server_port)


def auth_failures_counter(registry: CollectorRegistry) -> Counter:
    """Calls refused UNAUTHENTICATED, by surface (public, internal) and reason (missing, invalid)."""
    return Counter("splitserve_auth_failures", "Calls refused for a missing or wrong token",
                   ["surface", "reason"], registry=registry)


@dataclass
class RoutingMetrics:
    """KV-aware routing: what the gateway's prefix index predicted against what the worker
    that computed the prompt then reported (``leg``: ``prefill`` on a prefill worker,
    ``local`` on the decode worker itself), and why each leg went where it went."""

    predicted_hit_blocks: Counter
    hit_blocks: Counter
    mispredicted: Counter
    decisions: Counter
    local_prefills: Counter

    @classmethod
    def create(cls, r: CollectorRegistry) -> RoutingMetrics:
        return cls(
            predicted_hit_blocks=Counter("splitserve_routing_predicted_hit_blocks",
                                         "Prefix-cache hit blocks the gateway predicted for the worker it chose",
                                         ["leg"], registry=r),
            hit_blocks=Counter("splitserve_routing_hit_blocks",
                               "Prefix-cache hit blocks that worker then reported", ["leg"], registry=r),
            mispredicted=Counter("splitserve_routing_mispredicted_requests",
                                 "Requests whose reported hit differed from the prediction",
                                 ["leg", "direction"], registry=r),
            decisions=Counter("splitserve_routing_decisions",
                              "Legs routed, by what decided (prefix: a cache hit counted; load; imbalance: "
                              "the guard fell back to load)", ["leg", "reason"], registry=r),
            local_prefills=Counter("splitserve_routing_local_prefills",
                                   "Prompts the decode worker computed itself, by why (gateway/routing.py)",
                                   ["reason"], registry=r),
        )


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    in_flight: Gauge
    workers: Gauge
    retries: Counter
    migrations: Counter
    resumes: Counter
    leg_failures: Counter
    admission_waiting: Gauge
    admission_wait: Histogram
    admission_refused: Counter
    routing: RoutingMetrics
    auth_failures: Counter

    def count_auth_failure(self, surface: str, reason: str) -> None:
        self.auth_failures.labels(surface=surface, reason=reason).inc()

    def count_workers(self, count: Callable[[str], int]) -> None:
        """``splitserve_workers{role}`` read at each scrape from ``count(role)`` (it runs on
        the metrics server's thread: it must only read)."""
        for role in ("prefill", "decode"):
            self.workers.labels(role=role).set_function(lambda role=role: count(role))

    @classmethod
    def create(cls) -> GatewayMetrics:
        r = CollectorRegistry()
        return cls(
            routing=RoutingMetrics.create(r),
            registry=r,
            requests=Counter("splitserve_requests", "Finished requests by outcome", ["outcome"], registry=r),
            ttft=Histogram("splitserve_ttft_seconds", "Time to first token", buckets=_TOKEN_LATENCY_BUCKETS,
                           registry=r),
            itl=Histogram("splitserve_inter_token_latency_seconds", "Gap between streamed tokens",
                          buckets=_TOKEN_LATENCY_BUCKETS, registry=r),
            e2e=Histogram("splitserve_e2e_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r),
            in_flight=Gauge("splitserve_requests_in_flight", "Requests being served", registry=r),
            workers=Gauge("splitserve_workers", "Registered workers serving, by role", ["role"], registry=r),
            retries=Counter("splitserve_request_retries", "Requests re-routed before any token", registry=r),
            migrations=Counter("splitserve_request_migrations",
                               "Streams continued on another decode worker after tokens were sent", registry=r),
            resumes=Counter("splitserve_request_resumes",
                            "Requests a client sent again to continue a broken stream (GenerateRequest.resume)",
                            registry=r),
            leg_failures=Counter("splitserve_leg_failures", "Worker legs that failed, by the worker's role and "
                                 "status code (each one a retry, a migration or the request's error)",
                                 ["role", "code"], registry=r),
            admission_waiting=Gauge("splitserve_admission_waiting",
                                    "Requests waiting at this gateway for the prefill pool", registry=r),
            admission_wait=Histogram("splitserve_admission_wait_seconds",
                                     "Time requests waited for the prefill pool", buckets=_LATENCY_BUCKETS, registry=r),
            admission_refused=Counter("splitserve_admission_refused",
                                      "Requests refused because the prefill pool stayed saturated", registry=r),
            auth_failures=auth_failures_counter(r),
        )


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry
    kv_blocks_used: Gauge
    kv_cache_usage: Gauge
    kv_blocks_free: Gauge
    kv_blocks_in_transfer: Gauge
    running: Gauge
    waiting: Gauge
    transfer_bytes: Counter
    transfer_seconds: Histogram
    transfers: Counter
    prompt_tokens: Counter
    generated_tokens: Counter
    spec_drafts: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    spec_accepted_per_position: Counter
    auth_failures: Counter
    prefix_cache_hit_tokens: Counter
    received_prompt_tokens: Counter
    leases_expired: Counter
    lease_renewals: Counter
    step_seconds: Histogram  # labelled by kind: "decode" (no prompt token) or "prefill"
    _spec_seen: dict = None  # type: ignore[assignment]
    _totals_seen: dict = None  # type: ignore[assignment]

    def observe_totals(self, num_cached_prompt_tokens: int, num_received_prompt_tokens: int) -> None:
        """Advance the prompt-token counters to the engine's running totals."""
        seen = self._totals_seen or {}
        for key, counter, total in (("cached", self.prefix_cache_hit_tokens, num_cached_prompt_tokens),
                                    ("received", self.received_prompt_tokens, num_received_prompt_tokens)):
            if total > seen.get(key, 0):
                counter.inc(total - seen.get(key, 0))
                seen[key] = total
        self._totals_seen = seen

    def observe_step(self, seconds: float, prefill: bool) -> None:
        """One engine step (engine thread)."""
        self.step_seconds.labels(role=self._role, kind="prefill" if prefill else "decode").observe(seconds)

    def count_auth_failure(self, surface: str, reason: str) -> None:
        self.auth_failures.labels(surface=surface, reason=reason).inc()

    def observe_spec(self, stats: object) -> None:
        """Advance the speculative-decoding counters to the engine's running totals."""
        seen = self._spec_seen or {}
        for key, counter in (("num_drafts", self.spec_drafts), ("num_draft_tokens", self.spec_draft_tokens),
                             ("num_accepted_tokens", self.spec_accepted_tokens)):
            total = getattr(stats, key)
            if total > seen.get(key, 0):
                counter.inc(total - seen.get(key, 0))
            seen[key] = total
        for position, total in enumerate(getattr(stats, "accepted_per_position")):
            key = f"pos{position}"
            if total > seen.get(key, 0):
                self.spec_accepted_per_position.labels(role=self.role, position=str(position)).inc(total - seen.get(key, 0))
            seen[key] = total
        self._spec_seen = seen

    @property
    def role(self) -> str:
        return self._role

    @classmethod
    def create(cls, role: str) -> WorkerMetrics:
        r = CollectorRegistry()
        labels = {"role": role}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)  # type: ignore[return-value]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            c = Counter(name, doc, [*labels, *(extra or [])], registry=r)
            return c if extra else c.labels(**labels)  # type: ignore[return-value]

        metrics = cls(
            registry=r,
            kv_blocks_used=gauge("splitserve_kv_blocks_used", "KV blocks owned by requests"),
            kv_cache_usage=gauge("splitserve_kv_cache_usage_ratio",
                                 "Share of the KV pool owned by requests, 0 to 1 (the Gateway API Inference "
                                 "Extension's KV-cache utilisation)"),
            kv_blocks_free=gauge("splitserve_kv_blocks_free", "KV blocks free or evictable"),
            kv_blocks_in_transfer=gauge("splitserve_kv_blocks_in_transfer",
                                        "KV blocks reserved for (decode) or held for (prefill) a transfer"),
            running=gauge("splitserve_requests_running", "Requests in the running batch"),
            waiting=gauge("splitserve_requests_waiting", "Requests waiting to be scheduled"),
            transfer_bytes=counter("splitserve_kv_transfer_bytes", "KV bytes moved between workers"),
            transfer_seconds=Histogram("splitserve_kv_transfer_seconds", "KV transfer latency per request",
                                       ["role"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels),
            transfers=counter("splitserve_kv_transfers", "KV transfers by outcome", ["outcome"]),
            prompt_tokens=counter("splitserve_prompt_tokens", "Prompt tokens computed"),
            generated_tokens=counter("splitserve_generated_tokens", "Tokens generated"),
            spec_drafts=counter("splitserve_spec_decode_drafts", "Speculative proposals verified"),
            spec_draft_tokens=counter("splitserve_spec_decode_draft_tokens", "Draft tokens verified"),
            spec_accepted_tokens=counter("splitserve_spec_decode_accepted_tokens", "Draft tokens accepted"),
            spec_accepted_per_position=counter("splitserve_spec_decode_accepted_per_position",
                                               "Drafts whose token at this position was accepted", ["position"]),
            auth_failures=auth_failures_counter(r),
            prefix_cache_hit_tokens=counter("splitserve_prefix_cache_hit_tokens",
                                            "Prompt tokens served by this worker's prefix cache (decode: "
                                            "reservation hits whose pages did not travel)"),
            received_prompt_tokens=counter("splitserve_kv_received_prompt_tokens",
                                           "Prompt tokens whose KV pages arrived from a prefill worker"),
            leases_expired=counter("splitserve_kv_leases_expired",
                                   "Decode reservations freed because their pages did not arrive within the lease"),
            lease_renewals=counter("splitserve_kv_lease_renewals",
                                   "Decode reservation leases renewed by a prefill worker's keep-alive"),
            step_seconds=Histogram("splitserve_engine_step_seconds",
                                   "Engine steps by kind: prefill (computed prompt tokens) or decode",
                                   ["role", "kind"], buckets=_TOKEN_LATENCY_BUCKETS, registry=r),
        )
        metrics._role = role
        return metrics
