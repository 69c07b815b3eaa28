"""The online section: load against a running deployment, run by run.

``measure`` runs one request set under one :class:`LoadPlan` while sampling KV utilisation,
with a progress bar, and returns the run's report entry. ``run_online`` runs the profile's
plan: a closed-loop capacity run, a Poisson sweep at fractions of the capacity it measured
(or at explicit rates), and a closed-loop long-prompt mix.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import workload
from bench.loadgen import LoadGenerator, LoadPlan
from bench.machine import load_window
from bench.metrics import RequestRecord, Slo
from bench.monitor import KvMonitor, KvSample
from bench.profiles import OnlineProfile, WorkloadShapes
from bench.summary import errors, run_summary
from bench.workload import RequestSpec


@dataclass(frozen=True)
class ModelInfo:
    """What the workloads need to know about the served model."""

    path: Path
    vocab_size: int
    max_model_len: int

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelInfo:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(Path(model_dir), int(config["vocab_size"]), int(config["max_position_embeddings"]))


def make_workload(name: str, num_requests: int, seed: int, shapes: WorkloadShapes,
                  model: ModelInfo) -> tuple[list[RequestSpec], str]:
    """The named workload's requests and a one-line description of where they come from."""
    if shapes.max_len() > model.max_model_len:
        raise ValueError(f"workload lengths reach {shapes.max_len()} tokens, over the model's "
                         f"{model.max_model_len}")
    if name == "synthetic":
        reqs = workload.synthetic(num_requests, seed, model.vocab_size, shapes.synthetic_prompt,
                                  shapes.synthetic_output)
        return reqs, "random token ids"
    if name == "code":
        return workload.code_prompts(model.path, num_requests, seed, shapes.code_prompt, shapes.code_output)
    if name == "long_mix":
        reqs = workload.long_mix(num_requests, seed, model.vocab_size, shapes.short_prompt,
                                 shapes.long_prompt, shapes.mix_output, shapes.long_fraction)
        return reqs, f"random token ids, {shapes.long_fraction:.0%} long prompts"
    raise ValueError(f"unknown workload {name!r}")


class ProgressBar:
    """A tqdm bar on stderr (tqdm comes with transformers); silent when disabled."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled,
                         dynamic_ncols=True, leave=True)

    def update(self, *_: object) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


async def _measure(address: str, requests: Sequence[RequestSpec], plan: LoadPlan, bar: ProgressBar,
                   kv_interval_s: float) -> tuple[list[RequestRecord], list[KvSample]]:
    monitor = KvMonitor(address, kv_interval_s)
    await monitor.start()
    try:
        async with LoadGenerator(address) as gen:
            records = await gen.run(requests, plan, on_done=bar.update)
    finally:
        samples = await monitor.stop()
    return records, samples


def request_rows(records: Sequence[RequestRecord], t0: float) -> list[dict]:
    """Per-request raw data, in seconds: ``send_s``/``end_s`` from ``t0`` (the run's first send),
    ``chunk_times_s`` from the request's own send."""
    rows = []
    for r in records:
        row = {"index": r.index, "kind": r.kind, "num_prompt_tokens": r.num_prompt_tokens,
               "num_output_tokens": r.num_output_tokens, "send_s": round(r.send_s - t0, 6),
               "end_s": round(r.end_s - t0, 6), "error": r.error,
               "chunk_times_s": [round(t - r.send_s, 6) for t in r.chunk_times_s],
               "chunk_num_tokens": list(r.chunk_num_tokens)}
        if r.server is not None:
            row["server_timings"] = asdict(r.server)
        rows.append(row)
    return rows


def measure(address: str, name: str, workload: str, requests: Sequence[RequestSpec], plan: LoadPlan,
            slo: Slo, progress: bool, kv_interval_s: float = 0.1) -> tuple[dict, list[RequestRecord]]:
    """Run one request set; return its report entry and the records (for the plots)."""
    bar = ProgressBar(len(requests), f"{name} ({plan.describe()})", progress)
    try:
        with load_window() as load:
            records, samples = asyncio.run(_measure(address, requests, plan, bar, kv_interval_s))
    finally:
        bar.close()
    t0 = min(r.send_s for r in records)
    entry = {"name": name, "workload": workload, "plan": plan.to_dict(),
             "load_average_1m": load,
             **run_summary(records, slo, samples), "errors": errors(records),
             "kv_timeline": [s.to_dict(t0) for s in samples], "requests": request_rows(records, t0)}
    return entry, records


def sweep_rates(profile: OnlineProfile, capacity_rps: float) -> list[float]:
    if profile.sweep_rates:
        return list(profile.sweep_rates)
    return [f * capacity_rps for f in profile.sweep_fractions]


def run_online(address: str, profile: OnlineProfile, model: ModelInfo, slo: Slo, seed: int,
               progress: bool) -> dict:
    """The capacity run, the rate sweep and the long-prompt mix against ``address``."""
    runs: list[dict] = []
    shapes, sources = profile.shapes, {}

    def one(name: str, workload: str, num: int, plan: LoadPlan, run_seed: int) -> dict:
        reqs, sources[workload] = make_workload(workload, num, run_seed, shapes, model)
        entry, _ = measure(address, name, workload, reqs, plan, slo, progress)
        runs.append(entry)
        return entry

    capacity = one("capacity", profile.capacity_workload, profile.capacity_requests,
                   LoadPlan("closed", concurrency=profile.capacity_concurrency), seed)
    capacity_rps = capacity["figures"]["requests_per_s"] if "skipped" not in capacity["figures"] else 1.0
    rates = sweep_rates(profile, capacity_rps)
    for i, rate in enumerate(rates):
        one(f"sweep-{i}", profile.sweep_workload, profile.sweep_requests,
            LoadPlan("open", rate_rps=rate, seed=seed + 100 + i), seed + 1)
    one("long_mix", "long_mix", profile.mix_requests,
        LoadPlan("closed", concurrency=profile.mix_concurrency), seed + 2)
    section = {"slo": {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000},
               "capacity_rps": capacity_rps, "sweep_rates_rps": rates,
               "sweep": ("explicit rates" if profile.sweep_rates
                         else f"fractions {list(profile.sweep_fractions)} of the capacity run's request rate"),
               "workload_sources": sources, "runs": runs}
    return section


def run_custom(address: str, custom: object, shapes: WorkloadShapes, model: ModelInfo, slo: Slo, seed: int,
               progress: bool) -> dict:
    """The flags' plan (``options.CustomOnline``): one workload under each of its load plans."""
    runs, sources = [], {}
    for i, plan in enumerate(custom.plans):
        reqs, sources[custom.workload] = make_workload(custom.workload, custom.num_requests, seed, shapes, model)
        name = f"{plan.mode}-{i}" if len(custom.plans) > 1 else plan.mode
        entry, _ = measure(address, name, custom.workload, reqs, plan, slo, progress)
        runs.append(entry)
    return {"slo": {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000},
            "sweep": "the plan given by the flags", "workload_sources": sources, "runs": runs}
