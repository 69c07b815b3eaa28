"""The three systems under test, each timed over the same prompts.

* ``ours``: splitserve's in-process ``Engine.generate`` (all requests at once; ``bench/engine_run.py``,
  in the package, since deployments take its limits).
* ``hf_sequential``: ``transformers`` ``generate``, one request at a time (batch 1, KV cache on).
* ``hf_batch``: ``transformers`` ``generate_batch`` (its own continuous batching over a paged
  cache; on CPU it runs with the ``sdpa`` attention implementation).

Every runner warms up untimed on a couple of short requests first, then times only the
generation call(s) with ``time.perf_counter``; model loading is outside the timed region. Each
returns a :class:`SystemRun` whose ``output_ids`` are in request order, so outputs can be
compared across systems.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from bench.engine_run import WARMUP_OUTPUT_LEN, EngineSettings, SystemRun, run_ours  # noqa: F401 (run_ours: re-exported)
from bench.engine_run import check_lengths as _check_lengths
from bench.engine_run import describe_error as _describe_error
from bench.engine_run import warmup_prompts as _warmup_prompts
from bench.workload import Workload


def _load_hf_model(model_dir: Path, attn_implementation: str):  # -> LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _hf_generate_one(model, prompt: list[int], output_len: int) -> list[int]:
    input_ids = torch.tensor([prompt], dtype=torch.long)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        use_cache=True,
        max_new_tokens=output_len,
        min_new_tokens=output_len,  # ignore EOS
        pad_token_id=0,
    )
    return output[0, len(prompt):].tolist()


def run_hf_sequential(model_dir: Path, prompts: list[list[int]], workload: Workload) -> SystemRun:
    """``generate`` one request at a time over ``prompts`` (the caller passes the sample)."""
    run = SystemRun(system="hf_sequential", num_requests=len(prompts),
                    details={"attn_implementation": "sdpa", "batch_size": 1})
    try:
        model = _load_hf_model(model_dir, "sdpa")
        with torch.inference_mode():
            _hf_generate_one(model, _warmup_prompts(workload)[0], WARMUP_OUTPUT_LEN)
            per_request_seconds = []
            for prompt in prompts:
                start = time.perf_counter()
                run.output_ids.append(_hf_generate_one(model, prompt, workload.output_len))
                per_request_seconds.append(time.perf_counter() - start)
        run.seconds = sum(per_request_seconds)
        run.details["per_request_seconds"] = per_request_seconds
        run.num_output_tokens = sum(len(ids) for ids in run.output_ids)
        _check_lengths(run, workload.output_len)
    except Exception as exc:
        run.error = _describe_error(exc)
        run.details["traceback"] = traceback.format_exc()
    return run


def _hf_batch_generate(model, prompts: list[list[int]], output_len: int,
                       cb_config_kwargs: dict) -> list[list[int]]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=output_len, eos_token_id=None, pad_token_id=0
    )
    results = model.generate_batch(
        prompts,
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(**cb_config_kwargs),
    )
    # generate_batch returns {request_id: GenerationOutput} in input order; it logs (does not
    # raise) failed or missing requests, so check for them here.
    outputs = list(results.values())
    failed = [out.request_id for out in outputs if out.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(
            f"generate_batch returned {len(outputs)}/{len(prompts)} results; failed: {failed[:8]}"
        )
    return [list(out.generated_tokens) for out in outputs]


def hf_batch_cache_kwargs(workload: Workload, settings: EngineSettings,
                          page_size: int) -> dict:
    """``ContinuousBatchingConfig`` fields matching our engine's limits: room for every request
    at its longest, the same batch-token budget and the same number of running requests.
    (Set explicitly: without psutil, transformers cannot size the cache from CPU memory.)"""
    pages_per_request = -(-workload.max_model_len // page_size)
    return {
        "page_size": page_size,
        "num_blocks": workload.num_requests * pages_per_request,
        "max_batch_tokens": settings.max_num_batched_tokens,
        "max_requests_per_batch": settings.max_num_seqs,
    }


def run_hf_batch(model_dir: Path, prompts: list[list[int]], workload: Workload,
                 cb_config_kwargs: dict, attn_implementation: str = "sdpa") -> SystemRun:
    """``generate_batch`` over all prompts in one call (manager creation included in the time)."""
    run = SystemRun(system="hf_batch", num_requests=len(prompts),
                    details={"attn_implementation": attn_implementation,
                             "continuous_batching_config": dict(cb_config_kwargs)})
    try:
        model = _load_hf_model(model_dir, attn_implementation)
        _hf_batch_generate(model, _warmup_prompts(workload), WARMUP_OUTPUT_LEN, cb_config_kwargs)
        start = time.perf_counter()
        run.output_ids = _hf_batch_generate(model, prompts, workload.output_len, cb_config_kwargs)
        run.seconds = time.perf_counter() - start
        run.num_output_tokens = sum(len(ids) for ids in run.output_ids)
        _check_lengths(run, workload.output_len)
    except Exception as exc:
        run.error = _describe_error(exc)
        run.details["traceback"] = traceback.format_exc()
    return run
