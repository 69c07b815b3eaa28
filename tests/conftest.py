"""Shared fixtures: seeded random checkpoints and their transformers greedy references."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

# Kernel tests run Triton's interpreter on CPU tensors. Triton reads this when it is
# imported, so it must be set before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per test process: the suite's models are tiny, so intra-op threads
    buy nothing and, on a loaded machine, make every small op wait at OpenMP barriers.
    ``make test`` runs one process per core instead (pytest-xdist)."""
    import torch

    from engine import cpu_tuning

    torch.set_num_threads(1)
    # Engines built without num_threads would take every core; the suite's run one thread.
    cpu_tuning.default_num_threads = lambda: 1

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# A larger init spreads the logits of a random model, so greedy argmax has clear winners
# and float rounding (batched vs one-at-a-time matmuls) cannot flip a token.
INIT_RANGE = 0.15


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from tests.helpers.random_model import make_random_checkpoint

    made: dict[tuple, Path] = {}

    def get(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"ckpt-{arch}")
            shapes = dict(overrides)
            seed = int(shapes.pop("_seed", 1234))  # type: ignore[call-overload]
            made[key] = make_random_checkpoint(
                path, arch, seed=seed, initializer_range=INIT_RANGE, **shapes
            )
        return made[key]

    return get


def mixed_prompts(num: int, vocab: int, seed: int, min_len: int = 1, max_len: int = 300) -> list[list[int]]:
    """Prompts of mixed lengths, always including 1, exact block multiples and max_len."""
    rng = random.Random(seed)
    lengths = [1, 16, 32, max_len] + [rng.randint(min_len, max_len) for _ in range(num - 4)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths[:num]]


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[list[int]], int], list[list[int]]]:
    """transformers ``generate(do_sample=False)`` one prompt at a time, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    cache: dict[tuple, list[int]] = {}
    models: dict[Path, object] = {}

    def run(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if path not in models:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # else generate merges it back in
            models[path] = model
        model = models[path]
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
        )
        outs = []
        for prompt in prompts:
            key = (path, tuple(prompt), max_new_tokens)
            if key not in cache:
                with torch.inference_mode():
                    ids = torch.tensor([prompt])
                    seq = model.generate(ids, generation_config=gen)  # type: ignore[attr-defined]
                cache[key] = seq[0, len(prompt) :].tolist()
            outs.append(cache[key])
        return outs

    return run
