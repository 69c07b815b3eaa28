"""The benchmark workload: a seeded random-weight Llama on disk and seeded random prompts.

Both are pure functions of :class:`Workload`, so every system (and every run) sees the same
weights and the same requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the random-weight Llama (about 32M parameters at the defaults)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 8192
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class Workload:
    """What is generated: ``num_requests`` prompts of ``min_prompt_len..max_prompt_len`` random
    token ids (uniform, both ends included), ``output_len`` greedy tokens each, EOS ignored."""

    num_requests: int = 64
    output_len: int = 128
    min_prompt_len: int = 16
    max_prompt_len: int = 256
    seed: int = 0
    model: ModelShape = ModelShape()

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(
                f"need 1 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len}, "
                f"{self.max_prompt_len}"
            )
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"max_prompt_len + output_len = {self.max_model_len} exceeds the model's "
                f"max_position_embeddings = {self.model.max_position_embeddings}"
            )

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_len + self.output_len

    def to_dict(self) -> dict:
        return asdict(self)


def _model_config(shape: ModelShape):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(**asdict(shape), dtype="float32")


def _saved_shape_matches(model_dir: Path, shape: ModelShape) -> bool:
    config_path = model_dir / "config.json"
    if not config_path.is_file() or not any(model_dir.glob("*.safetensors")):
        return False
    saved = json.loads(config_path.read_text())
    return all(saved.get(key) == value for key, value in asdict(shape).items())


def ensure_model(model_dir: Path, shape: ModelShape, seed: int) -> Path:
    """Create the random-weight Llama in ``model_dir`` (seeded), or reuse the one saved there.

    A saved model is reused when its config has the same dimensions; the seed is recorded in
    ``bench_seed.txt`` and also has to match.
    """
    from transformers import LlamaForCausalLM

    seed_path = model_dir / "bench_seed.txt"
    if _saved_shape_matches(model_dir, shape) and seed_path.is_file():
        if seed_path.read_text().strip() == str(seed):
            return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_model_config(shape)).to(torch.float32)
    model.save_pretrained(model_dir)
    seed_path.write_text(f"{seed}\n")
    return model_dir


def make_prompts(workload: Workload) -> list[list[int]]:
    """Seeded random prompts: lengths uniform in [min_prompt_len, max_prompt_len], token ids
    uniform over the vocabulary."""
    generator = torch.Generator().manual_seed(workload.seed)
    prompt_lens = torch.randint(
        workload.min_prompt_len, workload.max_prompt_len + 1, (workload.num_requests,),
        generator=generator,
    )
    return [
        torch.randint(0, workload.model.vocab_size, (int(n),), generator=generator).tolist()
        for n in prompt_lens
    ]


def count_parameters(model_dir: Path) -> int:
    """Number of parameters in the saved checkpoint (read from the safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total
