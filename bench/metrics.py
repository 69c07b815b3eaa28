"""Per-request latency figures and their aggregates, from client-side request timelines.

Vocabulary (every time in seconds, measured by the load generator on one monotonic clock):

* **TTFT** (time to first token): send → arrival of the first chunk that carries a token.
* **E2E** (end-to-end latency): send → arrival of the final chunk (the one with the finish
  reason).
* **TPOT** (time per output token, one figure per request): (last token chunk − first token
  chunk) / (output tokens − 1). Undefined for a request with one output token.
* **ITL** (inter-token latency, one figure per gap): the time between two consecutive chunks
  that carry tokens, as vLLM's serving benchmark counts it. A chunk holding several tokens
  (speculative decoding) is one gap, not several.
* **Goodput** (DistServe): completed requests per second that met *both* SLOs, TTFT ≤
  ``ttft_s`` and TPOT ≤ ``tpot_s``. A one-token request has no TPOT and meets that SLO.
* **Greedy match**: how many requests produced exactly a reference system's tokens
  (:func:`match_outputs`), and where each other one first diverged.
* **Window**: a run's duration, from the first send to the last final chunk. Every rate
  (requests/s, tokens/s, goodput) divides by it.

Percentiles interpolate linearly between closest ranks (numpy's default ``method="linear"``,
Hyndman & Fan type 7): for sorted values ``x[0..n-1]`` the p-th percentile is
``x[lo] + (h - lo) * (x[lo + 1] - x[lo])`` with ``h = (n - 1) * p / 100`` and
``lo = floor(h)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class ServerTimings:
    """What the gateway reports on the final chunk (``PhaseTimings``), in its units."""

    queue_us: int = 0
    prefill_us: int = 0
    transfer_us: int = 0
    transfer_bytes: int = 0
    first_token_us: int = 0
    total_us: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    transfer_wire_us: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """One request's timeline. ``chunk_times_s[i]`` is when the i-th chunk that carried tokens
    arrived and ``chunk_num_tokens[i]`` how many it carried; ``end_s`` is when the stream ended
    (final chunk, or the error)."""

    index: int
    kind: str
    num_prompt_tokens: int
    send_s: float
    chunk_times_s: tuple[float, ...]
    chunk_num_tokens: tuple[int, ...]
    end_s: float
    error: str | None = None
    server: ServerTimings | None = None
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.chunk_times_s) != len(self.chunk_num_tokens):
            raise ValueError("chunk_times_s and chunk_num_tokens must have the same length")
        if any(n < 1 for n in self.chunk_num_tokens):
            raise ValueError("every recorded chunk carries at least one token")

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times_s)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)

    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0, got ttft_s={self.ttft_s}, tpot_s={self.tpot_s}")

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        return ttft is not None and ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 ≤ p ≤ 100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"p must be in [0, 100], got {p}")
    ordered = sorted(values)
    h = (len(ordered) - 1) * p / 100.0
    lo = math.floor(h)
    if lo + 1 >= len(ordered):
        return float(ordered[-1])
    return float(ordered[lo] + (h - lo) * (ordered[lo + 1] - ordered[lo]))


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Mean and P50/P90/P99 of ``values``, each multiplied by ``scale`` (1000: seconds → ms)."""
    if not values:
        raise ValueError("distribution of no values")
    out = {"mean": scale * sum(values) / len(values)}
    for p in PERCENTILES:
        out[f"p{p:g}"] = scale * percentile(values, p)
    return out


def window_s(records: Iterable[RequestRecord]) -> float:
    """First send to last stream end."""
    records = list(records)
    if not records:
        raise ValueError("window of no requests")
    return max(r.end_s for r in records) - min(r.send_s for r in records)


def goodput_rps(records: Sequence[RequestRecord], slo: Slo, window: float) -> float:
    """Requests per second that completed and met both SLOs."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    return sum(1 for r in records if slo.met_by(r)) / window


def slo_attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    """Fraction of all requests (failed ones included) that met both SLOs."""
    if not records:
        raise ValueError("attainment of no requests")
    return sum(1 for r in records if slo.met_by(r)) / len(records)


@dataclass(frozen=True)
class Throughput:
    requests_per_s: float
    output_tokens_per_s: float
    input_tokens_per_s: float


def throughput(records: Sequence[RequestRecord], window: float) -> Throughput:
    """Completed requests and their tokens per second of ``window``."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    done = [r for r in records if r.ok]
    return Throughput(
        requests_per_s=len(done) / window,
        output_tokens_per_s=sum(r.num_output_tokens for r in done) / window,
        input_tokens_per_s=sum(r.num_prompt_tokens for r in done) / window,
    )


def all_itls_s(records: Iterable[RequestRecord], within: tuple[float, float] | None = None) -> list[float]:
    """Every inter-token gap of completed requests; with ``within=(start, end)``, only the gaps
    that ended inside that interval."""
    gaps = []
    for record in records:
        if not record.ok:
            continue
        times = record.chunk_times_s
        for earlier, later in zip(times, times[1:]):
            if within is None or within[0] <= later <= within[1]:
                gaps.append(later - earlier)
    return gaps


def spec_acceptance_rate(records: Iterable[RequestRecord]) -> float | None:
    """Accepted / verified draft tokens over all requests; None when nothing was drafted."""
    drafted = accepted = 0
    for record in records:
        if record.server is not None:
            drafted += record.server.num_draft_tokens
            accepted += record.server.num_accepted_tokens
    return accepted / drafted if drafted else None


@dataclass(frozen=True)
class Match:
    """How many of ``num_compared`` requests had identical greedy outputs in two systems, and
    where each differing request first diverged (request index -> token position)."""

    num_equal: int
    num_compared: int
    first_divergence: dict[int, int]

    @property
    def fraction(self) -> str:
        return f"{self.num_equal}/{self.num_compared}"

    def to_dict(self) -> dict:
        return {"matches": self.fraction, "num_equal": self.num_equal, "num_compared": self.num_compared,
                "first_divergence": {str(k): v for k, v in self.first_divergence.items()}}


def match_outputs(candidate: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> Match:
    """Compare the first ``min(len(candidate), len(reference))`` requests token by token."""
    num_compared = min(len(candidate), len(reference))
    divergence: dict[int, int] = {}
    for i in range(num_compared):
        ours, theirs = list(candidate[i]), list(reference[i])
        if ours != theirs:
            divergence[i] = next((pos for pos, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                                 min(len(ours), len(theirs)))
    return Match(num_compared - len(divergence), num_compared, divergence)
