"""The ``throughput`` step: our engine on an 8B-shaped random Llama in bfloat16 (Llama-3-8B's
dimensions; weights drawn on the GPU, ``bench.gpu.models``) at each batch size, every
request ``prompt_len`` random tokens in and ``output_len`` out (greedy, EOS ignored), all
requests added at once.

Per batch size: the prefill phase (until every request has its first token), then the
decode phase, each decode step timed on the host (a step ends by copying its sampled
tokens to the host, so the GPU's work is done). The decode step's achieved bandwidth is
(weight bytes + K/V bytes it reads) / its time, where a step reads every matrix once (the
embedding table aside) and each running sequence's whole context; the roofline fraction
divides it by the copy bandwidth measured in this process. A batch size that reaches its
time cap (``--batch-budget-s``) is aborted there: its figures cover the steps that ran and
say ``truncated``.
"""

from __future__ import annotations

import random
import time
import traceback
from dataclasses import asdict

import torch

from bench.gpu.bandwidth import copy_bandwidth
from bench.gpu.device import device_for, free_memory, synchronize
from bench.gpu.models import config_only_checkpoint, device_weights, weight_bytes_read_per_step, weights_made_on_device
from bench.gpu.options import GpuCheckOptions

BLOCK_SIZE = 16


def _engine(options: GpuCheckOptions, device: torch.device):
    from engine import Engine, EngineConfig

    shape = options.profile.throughput_model
    model_dir = config_only_checkpoint(options.cache_dir / f"throughput-{options.profile.name}", shape)
    max_len = options.prompt_len + options.output_len
    max_batch = max(options.batch_sizes)
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", device=str(device), block_size=BLOCK_SIZE,
                          num_kv_blocks=max_batch * -(-max_len // BLOCK_SIZE) + 8, max_num_seqs=max_batch,
                          max_num_batched_tokens=64 if options.dry_run else 8192, max_model_len=max_len,
                          enable_prefix_caching=False, detokenize=False)
    weights = device_weights(shape, torch.bfloat16, device, options.seed)
    with weights_made_on_device(weights):
        return Engine(config), model_dir


class _Phases:
    """Counters of one batch size's run."""

    def __init__(self) -> None:
        self.first_token_s: float | None = None
        self.decode_steps = 0
        self.decode_s = 0.0
        self.decode_tokens = 0
        self.kv_bytes_read = 0
        self.total_tokens = 0


def _run(engine, prompts: list[list[int]], output_len: int, kv_token_bytes: int, stop_at: float) -> tuple[_Phases, bool, float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    phases = _Phases()
    start = time.perf_counter()
    generated = {engine.add_request(p, params): 0 for p in prompts}
    prompt_len = len(prompts[0])
    truncated = False
    while engine.has_unfinished_requests():
        if time.perf_counter() > stop_at:
            truncated = True
            for request_id in generated:
                engine.abort(request_id)
            break
        decoding = phases.first_token_s is not None
        context = sum(prompt_len + g for g in generated.values() if g < output_len)
        step_start = time.perf_counter()
        outputs = engine.step()
        step_tokens = sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            generated[o.request_id] += len(o.new_token_ids)
        phases.total_tokens += step_tokens
        if decoding:
            phases.decode_s += time.perf_counter() - step_start
            phases.decode_steps += 1
            phases.decode_tokens += step_tokens
            phases.kv_bytes_read += context * kv_token_bytes
        elif all(g >= 1 for g in generated.values()):
            phases.first_token_s = time.perf_counter() - start
    return phases, truncated, time.perf_counter() - start


def _figures(batch: int, options: GpuCheckOptions, phases: _Phases, truncated: bool, wall_s: float,
             weight_bytes: int, copy_gb_per_s: float) -> dict:
    out: dict = {"batch_size": batch, "prompt_len": options.prompt_len, "output_len": options.output_len,
                 "truncated": truncated, "wall_s": wall_s, "output_tokens": phases.total_tokens,
                 "output_tok_per_s": phases.total_tokens / wall_s, "prefill_s": phases.first_token_s,
                 "decode_steps": phases.decode_steps}
    if phases.first_token_s:
        out["prefill_tok_per_s"] = batch * options.prompt_len / phases.first_token_s
    if phases.decode_steps:
        bytes_read = phases.decode_steps * weight_bytes + phases.kv_bytes_read
        achieved = bytes_read / phases.decode_s / 1e9
        out.update(decode_s=phases.decode_s, decode_tok_per_s=phases.decode_tokens / phases.decode_s,
                   mean_decode_step_ms=1e3 * phases.decode_s / phases.decode_steps,
                   mean_bytes_per_decode_step=bytes_read / phases.decode_steps,
                   decode_gb_per_s=achieved, roofline_fraction=achieved / copy_gb_per_s)
    return out


def throughput_step(options: GpuCheckOptions, deadline: float) -> dict:
    device = device_for(options)
    copy = copy_bandwidth(options.profile.copy_bytes, device, 3 if options.dry_run else 10)
    free_memory(device)
    built = time.perf_counter()
    engine, model_dir = _engine(options, device)
    synchronize(device)
    out: dict = {"device": str(device), "model": {"shape": asdict(options.profile.throughput_model),
                 "dtype": "bfloat16", "weights": "random, drawn on the device",
                 "build_s": time.perf_counter() - built}, "copy_gb_per_s": copy["gb_per_s"]}
    weight_bytes = weight_bytes_read_per_step(model_dir, 2)
    out["model"]["weight_bytes_read_per_step"] = weight_bytes
    engine.generate([[5] * 16, [7] * 9], _warmup_params())  # untimed: Triton compiles its kernels
    out["batches"] = _batches(engine, options, weight_bytes, copy["gb_per_s"], deadline)
    return out


def _batches(engine, options: GpuCheckOptions, weight_bytes: int, copy_gb_per_s: float, deadline: float) -> dict:
    """Each batch size in turn, within the step's deadline; one that raises ends the series."""
    shape = options.profile.throughput_model
    rng = random.Random(options.seed)
    out: dict = {}
    for batch in options.batch_sizes:
        if time.monotonic() > deadline - 5:
            out[str(batch)] = {"skipped": "the step's deadline passed"}
            continue
        prompts = [[rng.randrange(3, shape.vocab_size) for _ in range(options.prompt_len)] for _ in range(batch)]
        try:
            # untimed, at this batch size: kernel variants Triton specializes on the batch compile here
            engine.generate([[5 + i % 7] * 16 for i in range(batch)], _warmup_params())
            stop_at = time.perf_counter() + min(options.batch_budget_s, deadline - time.monotonic())
            phases, truncated, wall_s = _run(engine, prompts, options.output_len, shape.kv_bytes_per_token(2), stop_at)
            engine.check_integrity()
        except Exception as exc:  # the smaller batches' figures stay; the engine's state is unknown now
            out[str(batch)] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            break
        out[str(batch)] = _figures(batch, options, phases, truncated, wall_s, weight_bytes, copy_gb_per_s)
    return out


def _warmup_params():
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
