"""One run's figures for the report, from its request records and KV samples.

A section of the report splits into ``figures`` (measured quantities: finite and positive;
``goodput_rps`` and ``slo_attainment`` may be 0 when no request met the SLOs) and ``counts``
(integers, possibly 0). A figure that does not apply to a run — KV transfer when every
prompt was prefilled locally, acceptance when speculation was off — is ``{"skipped":
reason}``, never 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench import metrics
from bench.metrics import RequestRecord, Slo
from bench.monitor import KvSample
from bench.figures import skipped

MS = 1000.0


def _dist_or_skip(values: Sequence[float], scale: float, reason: str) -> dict:
    return metrics.distribution(values, scale) if values else skipped(reason)


def latency_figures(records: Sequence[RequestRecord]) -> dict:
    done = [r for r in records if r.ok]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    return {
        "ttft_ms": _dist_or_skip([r.ttft_s for r in done], MS, "no request completed"),
        "tpot_ms": _dist_or_skip(tpots, MS, "no request produced two tokens"),
        "itl_ms": _dist_or_skip(metrics.all_itls_s(done), MS, "no request produced two chunks"),
        "e2e_ms": _dist_or_skip([r.e2e_s for r in done], MS, "no request completed"),
    }


def transfer_figures(records: Sequence[RequestRecord]) -> dict:
    remote = [r.server for r in records if r.ok and r.server is not None and r.server.transfer_bytes > 0]
    reason = "no request was prefilled remotely (no KV transfer)"
    return {
        "kv_transfer_ms": _dist_or_skip([s.transfer_us / 1000.0 for s in remote], 1.0, reason),
        "kv_transfer_kib": _dist_or_skip([s.transfer_bytes / 1024.0 for s in remote], 1.0, reason),
    }


def kv_utilisation_figures(samples: Sequence[KvSample]) -> dict:
    """Mean and peak used fraction per decode worker (prefill workers hold blocks only briefly;
    their samples stay in the timeline)."""
    out = {}
    for name in sorted({s.worker for s in samples if s.worker.startswith("decode")}):
        used = [s.kv_used_fraction for s in samples if s.worker == name]
        if max(used) > 0:
            out[name] = {"mean": sum(used) / len(used), "peak": max(used)}
        else:
            out[name] = skipped("no sample caught a KV block in use")
    return out or {"decode": skipped("no KV samples were taken")}


def run_summary(records: Sequence[RequestRecord], slo: Slo, samples: Sequence[KvSample] = ()) -> dict:
    """``figures`` and ``counts`` of one run (``figures`` as described in the module doc)."""
    done = [r for r in records if r.ok]
    counts = {"num_requests": len(records), "num_completed": len(done),
              "num_failed": len(records) - len(done),
              "num_output_tokens": sum(r.num_output_tokens for r in done),
              "num_input_tokens": sum(r.num_prompt_tokens for r in done)}
    if not done:
        return {"figures": skipped("every request failed"), "counts": counts}
    window = metrics.window_s(records)
    rates = metrics.throughput(records, window)
    acceptance = metrics.spec_acceptance_rate(done)
    figures = {
        **latency_figures(records),
        "window_s": window,
        "requests_per_s": rates.requests_per_s,
        "output_tokens_per_s": rates.output_tokens_per_s,
        "input_tokens_per_s": rates.input_tokens_per_s,
        "goodput_rps": metrics.goodput_rps(records, slo, window),
        "slo_attainment": metrics.slo_attainment(records, slo),
        **transfer_figures(records),
        "spec_decode_acceptance_rate": (acceptance if acceptance is not None
                                        else skipped("no draft tokens were verified (speculation off or backed off)")),
        "kv_utilisation": kv_utilisation_figures(samples),
    }
    return {"figures": figures, "counts": counts}


def errors(records: Sequence[RequestRecord], limit: int = 5) -> list[str]:
    """The first few distinct failure messages."""
    seen: list[str] = []
    for record in records:
        if record.error is not None and record.error not in seen:
            seen.append(record.error)
    return seen[:limit]
