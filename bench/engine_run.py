"""Our engine in process, timed over a workload: the limits it gets (``EngineSettings``), a
run's record (``SystemRun``) and ``run_ours`` (``Engine.generate`` over all prompts at once).

The deployments of ``bench.deployment`` take the same limits (``engine_flags``), so a
deployment and the in-process engine can be set alike; ``benchmarks/systems.py`` times the
other in-process systems (``transformers``) the same way. The runner warms up untimed on a
couple of short requests first, then times only the generation call with
``time.perf_counter``; model loading is outside the timed region, and ``output_ids`` are in
request order, so outputs can be compared across systems.
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


def warmup_prompts(workload: Workload) -> list[list[int]]:
    """Two short prompts drawn apart from the measured ones (so a prefix cache gains nothing)."""
    generator = torch.Generator().manual_seed(workload.seed + 1)
    return [
        torch.randint(0, workload.model.vocab_size, (WARMUP_PROMPT_LEN,), generator=generator).tolist()
        for _ in range(2)
    ]


def describe_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def check_lengths(run: SystemRun, output_len: int) -> None:
    """Every request must have produced exactly ``output_len`` tokens (EOS is ignored)."""
    bad = [i for i, ids in enumerate(run.output_ids) if len(ids) != output_len]
    if bad:
        lens = [len(run.output_ids[i]) for i in bad[:8]]
        raise RuntimeError(
            f"{run.system}: {len(bad)} request(s) did not produce {output_len} tokens "
            f"(request {bad[:8]} -> lengths {lens})"
        )


def engine_stats(engine) -> dict[str, int]:
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
        engine.generate(warmup_prompts(workload), warmup)
        stats_before = engine_stats(engine)
        params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        run.seconds = time.perf_counter() - start
        run.output_ids = [list(output.token_ids) for output in outputs]
        run.num_output_tokens = sum(len(ids) for ids in run.output_ids)
        run.details["engine_stats"] = {
            key: value - stats_before.get(key, 0) for key, value in engine_stats(engine).items()
        }
        check_lengths(run, workload.output_len)
    except Exception as exc:  # a benchmark reports the failure and goes on with the others
        run.error = describe_error(exc)
        run.details["traceback"] = traceback.format_exc()
    return run
