"""The front's own Prometheus metrics, served on its HTTP port at ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


@dataclass
class FrontMetrics:
    registry: CollectorRegistry
    requests: Counter  # by endpoint (completions, chat) and HTTP status (499: the client left)
    in_flight: Gauge

    @classmethod
    def create(cls) -> FrontMetrics:
        r = CollectorRegistry()
        return cls(
            registry=r,
            requests=Counter("splitserve_http_requests", "OpenAI-compatible requests answered, by endpoint and "
                             "HTTP status (499: the client disconnected)", ["endpoint", "status"], registry=r),
            in_flight=Gauge("splitserve_http_requests_in_flight", "OpenAI-compatible requests being served",
                            registry=r),
        )

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
