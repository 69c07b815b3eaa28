"""Load a checkpoint's weights and RoPE frequencies (its metadata: ``engine.models.spec``)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

from engine.models.gguf_reader import is_gguf
from engine.models.spec import read_config, require_dir


def load_hf_config(path: str) -> Any:
    """The checkpoint's ``transformers`` config (RoPE variants need it), architecture checked."""
    raw = read_config(path)
    if is_gguf(path):
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
            # All the default RoPE reads (rope_inv_freq); importing transformers for it was
            # most of a worker's cold start on a busy machine.
            return SimpleNamespace(**raw)
        from transformers import AutoConfig

        return AutoConfig.for_model(**raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(require_dir(path)))


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


def load_weights(path: str, dtype: torch.dtype, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every tensor of the checkpoint (single file or sharded with an index; or a GGUF
    file, dequantized except the types in ``keep``: engine.quant.linear.kept_gguf_types),
    cast to dtype."""
    if is_gguf(path):
        from engine.models.gguf_weights import load_gguf_weights

        return load_gguf_weights(path, dtype, keep)
    from safetensors.torch import load_file

    root = require_dir(path)
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
