"""Seeded random-weight checkpoints of the supported architectures (tests, benchmarks, demo).

Written with ``transformers`` ``save_pretrained`` so they load exactly like a downloaded
checkpoint, through our loader and through ``AutoModelForCausalLM``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Small shapes that exercise GQA, biases and q/k norms while staying fast on CPU.
TINY_SHAPES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
)


def make_random_checkpoint(
    path: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    initializer_range: float = 0.02,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Create (or reuse, if its config matches) a random checkpoint at ``path``."""
    import torch
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"architecture must be one of {sorted(classes)}, got {architecture!r}")
    config_cls, model_cls = classes[architecture]
    shapes = {**TINY_SHAPES, **overrides}
    config = config_cls(initializer_range=initializer_range, **shapes)
    path = Path(path)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(str(path))
    else:  # several *.safetensors files plus model.safetensors.index.json
        model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path
