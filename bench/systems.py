"""The three systems under test, each timed over the same prompts.

* ``ours``: splitserve's in-process ``Engine.generate`` (all requests at once).
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.workload import Workload

WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 8


@dataclass
class SystemRun:
    """Timing and outputs of one system. ``error`` is set (and the figures are zero) when the
    system failed; ``details`` holds system-specific settings worth reporting."""

    system: str
    num_requests: int
    num_output_tokens: int = 0
    seconds: float = 0.0
    output_ids: list[list[int]] = field(default_factory=list)
    error: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float | None:
        if self.error is not None or self.seconds <= 0.0:
            return None
        return self.num_output_tokens / self.seconds


@dataclass(frozen=True)
class EngineSettings:
    """Cache and batching limits given to our engine (and mirrored for ``generate_batch``)."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    @classmethod
    def for_workload(cls, workload: Workload, block_size: int = 16,
                     max_num_batched_tokens: int = 2048) -> EngineSettings:
        """Enough KV blocks for every request at its longest, so nothing is preempted."""
        blocks_per_request = -(-workload.max_model_len // block_size)
        return cls(
            block_size=block_size,
            num_kv_blocks=workload.num_requests * blocks_per_request,
            max_num_seqs=workload.num_requests,
            max_num_batched_tokens=max(max_num_batched_tokens, workload.max_model_len),
            max_model_len=workload.max_model_len,
        )


def _warmup_prompts(workload: Workload) -> list[list[int]]:
    """Two short prompts drawn apart from the measured ones (so a prefix cache gains nothing)."""
    generator = torch.Generator().manual_seed(workload.seed + 1)
    return [
        torch.randint(0, workload.model.vocab_size, (WARMUP_PROMPT_LEN,), generator=generator).tolist()
        for _ in range(2)
    ]


def _describe_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check_lengths(run: SystemRun, output_len: int) -> None:
    """Every request must have produced exactly ``output_len`` tokens (EOS is ignored)."""
    bad = [i for i, ids in enumerate(run.output_ids) if len(ids) != output_len]
    if bad:
        lens = [len(run.output_ids[i]) for i in bad[:8]]
        raise RuntimeError(
            f"{run.system}: {len(bad)} request(s) did not produce {output_len} tokens "
            f"(request {bad[:8]} -> lengths {lens})"
        )


def _engine_stats(engine) -> dict[str, int]:
    """The engine's step/token counters, if it keeps any (they are reported, not required)."""
    stats = getattr(engine, "stats", None)
    return {k: v for k, v in vars(stats).items() if isinstance(v, int)} if stats is not None else {}


def run_ours(model_dir: Path, prompts: list[list[int]], workload: Workload,
             settings: EngineSettings) -> SystemRun:
    """splitserve's ``Engine.generate`` over all prompts at once. Failures are recorded, not raised.

    The engine gets the thread count already set on torch, so every system runs with the same.
    """
    engine_kwargs = {**vars(settings), "num_threads": torch.get_num_threads()}
    run = SystemRun(system="ours", num_requests=len(prompts), details={"engine": engine_kwargs})
    try:
        from engine import Engine, EngineConfig, SamplingParams

        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", **engine_kwargs))
        run.details["engine_config"] = repr(engine.config)
        warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True)
        engine.generate(_warmup_prompts(workload), warmup)
        stats_before = _engine_stats(engine)
        params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        run.seconds = time.perf_counter() - start
        run.output_ids = [list(output.token_ids) for output in outputs]
        run.num_output_tokens = sum(len(ids) for ids in run.output_ids)
        run.details["engine_stats"] = {
            key: value - stats_before.get(key, 0) for key, value in _engine_stats(engine).items()
        }
        _check_lengths(run, workload.output_len)
    except Exception as exc:  # a benchmark reports the failure and goes on with the others
        run.error = _describe_error(exc)
        run.details["traceback"] = traceback.format_exc()
    return run


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
