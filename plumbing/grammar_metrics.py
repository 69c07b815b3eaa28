"""Structured-output metrics, read from a ``GrammarStats`` at each scrape (no polling).

``splitserve_constrained_requests`` (requests with a constraint), ``splitserve_grammar_compiles``
and ``splitserve_grammar_compile_seconds`` (compiles that missed the cache, and their time),
``splitserve_grammar_cache_hits``, ``splitserve_grammar_masked_rows`` and
``splitserve_grammar_mask_seconds`` (per-step masks: divide for the cost of one row). The
gateway compiles to validate (no masks); workers compile and mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from engine.grammar import GrammarStats

_COUNTERS = (
    ("splitserve_constrained_requests", "Requests with a structured-output constraint", "num_constrained_requests"),
    ("splitserve_grammar_compiles", "Grammar compiles (compile-cache misses)", "num_compiles"),
    ("splitserve_grammar_compile_seconds", "Time spent compiling grammars", "compile_seconds"),
    ("splitserve_grammar_cache_hits", "Constraints served by the compile cache", "num_cache_hits"),
    ("splitserve_grammar_masked_rows", "Logit rows masked by a grammar (one per row per step)", "num_mask_rows"),
    ("splitserve_grammar_mask_seconds", "Time spent computing and applying grammar masks", "mask_seconds"),
)


class GrammarCollector(Collector):
    def __init__(self, stats: Callable[[], GrammarStats | None], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), float(getattr(stats, attr)))
            yield family


def register_grammar_metrics(registry: CollectorRegistry, stats: Callable[[], GrammarStats | None],
                             labels: dict[str, str] | None = None) -> None:
    registry.register(GrammarCollector(stats, labels or {}))
