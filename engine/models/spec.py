"""What a checkpoint is, without loading it: architecture, shapes, limits, tokenizer.

Torch-free on purpose: the gateway needs a model's vocabulary, length limit and tokenizer,
never its weights, so it imports this module and nothing that loads torch. The weights
and the forward live in ``engine.models.loader`` and ``engine.models.llama``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.gguf_reader import gguf_config, is_gguf

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


def require_dir(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model: {path!r} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"model: {path!r} has no config.json (not a Hugging Face checkpoint)")
    return root


def read_config(path: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict (a GGUF file's metadata in that form),
    after checking the architecture."""
    if is_gguf(path):
        return gguf_config(path)
    root = require_dir(path)
    with open(root / "config.json") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return raw


class _RawConfig:
    """Attribute access over a raw ``config.json`` dict, with RoPE settings normalised the
    way ``transformers`` does (``rope_parameters``, or legacy ``rope_theta`` + ``rope_scaling``)."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.__dict__.update(raw)
        if not raw.get("rope_parameters"):
            scaling = dict(raw.get("rope_scaling") or {})
            rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
            self.rope_parameters = {**scaling, "rope_type": rope_type,
                                    "rope_theta": raw.get("rope_theta", 10000.0)}


def load_model_spec(path: str) -> ModelSpec:
    """The architecture facts of the checkpoint at ``path``, read without torch."""
    return model_spec_from_config(read_config(path))


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
    """From a ``transformers`` config or a raw ``config.json`` dict (the same result)."""
    if isinstance(cfg, Mapping):
        cfg = _RawConfig(cfg)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model: rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    arch = cfg.architectures[0]
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelSpec(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=_sliding_window(cfg),
        eos_token_ids=eos_ids,
        bos_token_id=getattr(cfg, "bos_token_id", None),
    )


def resolve_max_model_len(requested: int | None, spec: ModelSpec) -> int:
    """``requested`` (None: the model's limit), checked against what the model supports."""
    limit = spec.max_position_embeddings
    if spec.sliding_window is not None:
        # Sliding-window attention is not implemented: stay inside the window, where
        # full attention is exact.
        limit = min(limit, spec.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens")
    return requested


def load_tokenizer(path: str) -> Any | None:
    """The checkpoint's Hugging Face tokenizer, or None when the directory has none."""
    if is_gguf(path):
        from engine.models.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)
    root = Path(path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    # The fast-tokenizer class reads tokenizer.json, its config and chat template without
    # importing torch (AutoTokenizer goes through AutoConfig, which does).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(root))


def eos_token_ids(path: str, spec: ModelSpec) -> tuple[int, ...]:
    """EOS ids as ``generate`` uses them: generation_config.json first, then config.json
    (a GGUF file: its EOS, end-of-turn and end-of-message tokens)."""
    if is_gguf(path):
        return spec.eos_token_ids
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return spec.eos_token_ids
