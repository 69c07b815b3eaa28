"""Disaggregation against colocation under long-prompt interference (DistServe's experiment,
scaled to this machine).

Per deployment mode, on one event loop:

1. ``decode_clients`` closed-loop clients keep short-prompt, long-output requests running
   (the "running decodes"); alone, they give the **baseline** inter-token latency;
2. then a Poisson stream of ``num_long`` long prompts (few output tokens each) arrives at
   ``long_rate_rps``; the decode clients keep going until the last long prompt finished,
   then send nothing new and drain.

The figure is the inter-token latency of the decode clients' requests over the gaps that
ended while the long prompts were arriving or running (``[first long send, last long end]``).
Colocated, each long prompt's prefill shares a batch with the running decodes and stalls
them for the whole forward; disaggregated, it runs on the prefill worker and the decode
worker only admits the received pages. Colocated runs on all the cores and, when that is
more than one, also on a single thread (a small model can decode faster on one);
``itl_p99_ratio`` = disaggregated P99 / the better colocated variant's P99.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from bench import metrics
from bench.deployment import DeploymentPool, DeploymentSpec
from bench.loadgen import LoadGenerator
from bench.machine import load_window
from bench.metrics import RequestRecord
from bench.online import ModelInfo, ProgressBar, request_rows
from bench.profiles import InterferenceProfile
from bench.figures import skipped
from bench.summary import MS, errors, transfer_figures
from bench.workload import LengthDist, RequestSpec, synthetic

DECODE_REQUESTS_PER_CLIENT = 200  # more than any run uses: the clients stop when told


def make_requests(profile: InterferenceProfile, model: ModelInfo,
                  seed: int) -> tuple[list[RequestSpec], list[RequestSpec]]:
    longest = max(profile.decode_prompt.hi + profile.decode_output, profile.long_prompt.hi + profile.long_output)
    if longest > model.max_model_len:
        raise ValueError(f"interference lengths exceed the model's {model.max_model_len} positions")
    decode = synthetic(profile.decode_clients * DECODE_REQUESTS_PER_CLIENT, seed, model.vocab_size,
                       profile.decode_prompt, LengthDist(profile.decode_output, profile.decode_output), "decode")
    long = synthetic(profile.num_long, seed + 1, model.vocab_size, profile.long_prompt,
                     LengthDist(profile.long_output, profile.long_output), "long")
    return decode, long


async def _interfere(address: str, decode: list[RequestSpec], long: list[RequestSpec],
                     profile: InterferenceProfile, seed: int, bar: ProgressBar,
                     ) -> tuple[list[RequestRecord], list[RequestRecord], tuple[float, float], float]:
    async with LoadGenerator(address) as gen:
        stop = asyncio.Event()
        decode_start = time.perf_counter()
        decode_task = asyncio.ensure_future(gen.closed_loop(decode, profile.decode_clients, stop=stop))
        await asyncio.sleep(profile.baseline_s)
        long_records = await gen.open_loop(long, profile.long_rate_rps, seed, on_done=bar.update,
                                           first_index=len(decode))
        stop.set()
        decode_records = await decode_task
    window = (min(r.send_s for r in long_records), max(r.end_s for r in long_records))
    return decode_records, long_records, window, decode_start


def mode_figures(decode: Sequence[RequestRecord], long: Sequence[RequestRecord],
                 window: tuple[float, float], decode_start: float) -> dict:
    under = metrics.all_itls_s(decode, within=window)
    baseline = metrics.all_itls_s(decode, within=(decode_start, window[0]))
    long_done = [r for r in long if r.ok]
    return {
        "decode_itl_ms_under_interference": (metrics.distribution(under, MS) if under
                                             else skipped("no decode gap fell inside the interference window")),
        "decode_itl_ms_baseline": (metrics.distribution(baseline, MS) if baseline
                                   else skipped("no decode gap before the long prompts")),
        "long_prompt_ttft_ms": (metrics.distribution([r.ttft_s for r in long_done], MS) if long_done
                                else skipped("no long prompt completed")),
        "interference_window_s": window[1] - window[0],
        "long_prompt_kv_transfer_ms": transfer_figures(long)["kv_transfer_ms"],
    }


def run_mode(address: str, profile: InterferenceProfile, model: ModelInfo, seed: int, mode: str,
             progress: bool) -> dict:
    """One mode's report entry."""
    decode, long = make_requests(profile, model, seed)
    bar = ProgressBar(len(long), f"interference, {mode}", progress)
    try:
        with load_window() as load:
            decode_recs, long_recs, window, decode_start = asyncio.run(
                _interfere(address, decode, long, profile, seed, bar))
    finally:
        bar.close()
    everything = [*decode_recs, *long_recs]
    return {
        "figures": mode_figures(decode_recs, long_recs, window, decode_start),
        "counts": {"num_decode_requests": len(decode_recs), "num_long_prompts": len(long_recs),
                   "num_failed": sum(1 for r in everything if not r.ok),
                   "num_itl_gaps_under_interference": len(metrics.all_itls_s(decode_recs, within=window))},
        "errors": errors(everything),
        "load_average_1m": load,
        "requests": request_rows(everything, decode_start),
    }


def run_interference(profile: InterferenceProfile, specs: dict[str, DeploymentSpec], pool: DeploymentPool,
                     model: ModelInfo, seed: int, progress: bool,
                     keep: frozenset[DeploymentSpec] = frozenset()) -> dict:
    """Each mode in turn (``specs``: "disaggregated", then one or more "colocated..." variants);
    a mode's deployment is stopped after its run unless it is in ``keep``."""
    modes = {}
    for mode, spec in specs.items():
        modes[mode] = run_mode(pool.address(spec), profile, model, seed, mode, progress)
        modes[mode]["deployment"] = spec.describe()
        if spec not in keep:
            pool.release(spec)
    reference, figures = ratio_figures(modes)
    section = {"config": {k: (v.to_dict() if isinstance(v, LengthDist) else v) for k, v in vars(profile).items()},
               "modes": modes, "colocated_reference": reference, "figures": figures}
    return section


def ratio_figures(modes: dict) -> tuple[str | None, dict]:
    """Disaggregated ITL P99 over the best (lowest) colocated variant's, and that variant."""
    def p99(mode: str) -> float | None:
        figs = modes[mode]["figures"]["decode_itl_ms_under_interference"]
        return None if "skipped" in figs else figs["p99"]

    colocated = {m: p99(m) for m in modes if m.startswith("colocated") and p99(m) is not None}
    disagg = p99("disaggregated") if "disaggregated" in modes else None
    if disagg is None or not colocated:
        return None, {"itl_p99_ratio_disaggregated_vs_colocated": skipped("a mode has no ITL under interference")}
    best = min(colocated, key=colocated.get)
    return best, {"itl_p99_ratio_disaggregated_vs_colocated": disagg / colocated[best]}
