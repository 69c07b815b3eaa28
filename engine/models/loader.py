"""Load a local Hugging Face checkpoint directory: config, weights, architecture checks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# RoPE variants whose frequencies do not depend on the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the forward pass needs, read from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _require_dir(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model: {path!r} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"model: {path!r} has no config.json (not a Hugging Face checkpoint)")
    return root


def load_hf_config(path: str) -> Any:
    """The checkpoint's ``transformers`` config, after checking the architecture."""
    root = _require_dir(path)
    with open(root / "config.json") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(root))


def _sliding_window(cfg: Any) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)


def model_spec_from_config(cfg: Any) -> ModelSpec:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model: rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    arch = cfg.architectures[0]
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelSpec(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=_sliding_window(cfg),
        eos_token_ids=eos_ids,
        bos_token_id=getattr(cfg, "bos_token_id", None),
    )


def rope_inv_freq(cfg: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, computed as ``transformers`` does."""
    rope = cfg.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        base = rope["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def load_weights(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (single file or sharded with an index), cast to dtype."""
    from safetensors.torch import load_file

    root = _require_dir(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path!r}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(str(root / name)).items():
            weights[key] = tensor.to(dtype)
    return weights
