"""The GPU check's flags (each with a ``SPLITSERVE_GPU_CHECK_*`` env var) and its two
profiles: ``device`` (one H200: an 8B-shaped model, 1k/1k tokens) and ``dry`` (CPU, tiny
shapes, the Triton interpreter; what CI runs)."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STEPS = ("build", "kernels", "bandwidth", "parity", "handoff", "throughput")
DEFAULT_OUT = Path("bench/results/gpu")


def env_name(flag: str) -> str:
    return "SPLITSERVE_GPU_CHECK_" + flag.lstrip("-").replace("-", "_").upper()


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """An argument whose default comes from its ``SPLITSERVE_GPU_CHECK_*`` variable when set."""
    value = os.environ.get(env_name(flag))
    if value is not None:
        is_switch = kwargs.get("action") == "store_true"
        kwargs["default"] = value.lower() in ("1", "true", "yes", "on") if is_switch else kwargs.get("type", str)(value)
    kwargs["help"] = kwargs.get("help", "") + f" [env {env_name(flag)}]"
    parser.add_argument(flag, **kwargs)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's dimensions (``transformers.LlamaConfig`` names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


# Llama-3-8B's shape (8.0B parameters, 16 GB in bfloat16); its KV is 128 KiB a token.
LLAMA_8B = LlamaShape(4096, 14336, 32, 32, 8, 128256, 4096)
# SmolLM2-135M's shape: the "hidden-shape-style" random model of the parity step.
SMOLLM2_135M = LlamaShape(576, 1536, 30, 9, 3, 49152, 2048)
# The 8B model's KV shape (32 layers x 8 KV heads x 128) on a small body: the hand-off's model.
KV_8B_SMALL_BODY = LlamaShape(1024, 1024, 32, 8, 8, 8192, 4096)
TINY = LlamaShape(64, 128, 2, 4, 2, 512, 256)


@dataclass(frozen=True)
class Profile:
    """Shapes and sizes of one kind of run."""

    name: str
    parity_model: LlamaShape
    parity_prompts: int
    parity_new_tokens: int
    throughput_model: LlamaShape
    handoff_model: LlamaShape
    handoff_prompt_len: int
    handoff_requests: int
    attention_seqs: int
    attention_context: int
    attention_shape: LlamaShape
    copy_bytes: int
    kernel_head_dim: int


DEVICE = Profile("device", SMOLLM2_135M, 8, 32, LLAMA_8B, KV_8B_SMALL_BODY, 2048, 6,
                 64, 4096, LLAMA_8B, 4 << 30, 128)
DRY = Profile("dry", TINY, 3, 6, TINY, TINY, 48, 2, 3, 40, TINY, 8 << 20, 16)


@dataclass(frozen=True)
class GpuCheckOptions:
    """One run. ``dry_run``: CPU, tiny shapes, Triton interpreted (see ``bench/gpu``)."""

    out_dir: Path = DEFAULT_OUT
    dry_run: bool = False
    budget_s: float = 450.0
    steps: tuple[str, ...] = STEPS
    batch_sizes: tuple[int, ...] = (1, 16, 64, 256)
    prompt_len: int = 1024
    output_len: int = 1024
    batch_budget_s: float = 45.0
    smollm2: str | None = None  # a SmolLM2 GGUF, or a checkpoint bench.gpu.models sliced from one
    seed: int = 0
    cache_dir: Path = Path(".cache/gpu-check")
    profile: Profile = field(default=DEVICE)

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"steps: unknown {unknown}; choose from {list(STEPS)}")
        if self.budget_s <= 0 or self.batch_budget_s <= 0:
            raise ValueError("budget_s and batch_budget_s must be > 0")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be >= 1, got {self.batch_sizes}")
        if self.prompt_len < 1 or self.output_len < 2:
            raise ValueError("prompt_len must be >= 1 and output_len >= 2")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(out_dir=str(self.out_dir), cache_dir=str(self.cache_dir))
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> GpuCheckOptions:
        profile = DRY if raw["profile"]["name"] == "dry" else DEVICE
        return cls(**{**raw, "out_dir": Path(raw["out_dir"]), "cache_dir": Path(raw["cache_dir"]),
                      "steps": tuple(raw["steps"]), "batch_sizes": tuple(raw["batch_sizes"]),
                      "profile": profile})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    _add(p, "--out", default=str(DEFAULT_OUT), help="report folder (gpu_check.json, gpu_check.md)")
    _add(p, "--dry-run", action="store_true", default=False,
         help="CPU, tiny shapes, Triton interpreted (the default without a CUDA device)")
    _add(p, "--budget-s", type=float, default=None, help="the whole run's time budget (device 450, dry 600)")
    _add(p, "--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    _add(p, "--batch-sizes", default=None, help="throughput batch sizes (device 1,16,64,256; dry 1,2)")
    _add(p, "--prompt-len", type=int, default=None, help="throughput prompt tokens (device 1024, dry 16)")
    _add(p, "--output-len", type=int, default=None, help="throughput output tokens (device 1024, dry 8)")
    _add(p, "--batch-budget-s", type=float, default=45.0, help="cap on one throughput batch size's run")
    _add(p, "--smollm2", default=None, help="SmolLM2 GGUF or a checkpoint sliced from it (optional)")
    _add(p, "--seed", type=int, default=0, help="weights and prompts")
    _add(p, "--cache-dir", default=".cache/gpu-check", help="where the run's checkpoints go")
    return p


def options_from_args(args: argparse.Namespace, dry_run: bool) -> GpuCheckOptions:
    """Fill the profile's defaults into what the flags left unset."""
    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    return GpuCheckOptions(
        out_dir=Path(args.out), dry_run=dry_run,
        budget_s=args.budget_s if args.budget_s is not None else (600.0 if dry_run else 450.0),
        steps=tuple(s.strip() for s in args.steps.split(",") if s.strip()),
        batch_sizes=ints(args.batch_sizes or ("1,2" if dry_run else "1,16,64,256")),
        prompt_len=args.prompt_len or (16 if dry_run else 1024),
        output_len=args.output_len or (8 if dry_run else 1024),
        batch_budget_s=args.batch_budget_s, smollm2=args.smollm2, seed=args.seed,
        cache_dir=Path(args.cache_dir), profile=DRY if dry_run else DEVICE)
