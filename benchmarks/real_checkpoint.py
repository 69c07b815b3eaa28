"""The default model's real weights as a Hugging Face checkpoint both engines can load.

vLLM-CPU reads safetensors, not our GGUF file, and a benchmark must give both engines the
same weights: :func:`ensure_real_checkpoint` dequantises SmolLM2-135M-Instruct's Q4_1 GGUF
once with our own loader (``engine.models.loader.load_weights``, float32) and writes the
tensors with the file's metadata as ``config.json`` (tied embeddings: no ``lm_head``). Our
engine then loads that directory too, so the two run the same float32 numbers. Prompts are
token ids, so no tokenizer is written (``skip_tokenizer_init=True`` on vLLM's side).
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_DIR = Path(".cache/bench-smollm2-135m-instruct-f32")
_MARKER = "source.txt"


def ensure_real_checkpoint(model_dir: Path = DEFAULT_DIR, gguf: Path | None = None) -> Path:
    """``model_dir`` holding the default model's dequantised float32 weights (written once per
    source file; fetched with ``splitserve fetch``'s logic when ``gguf`` is None)."""
    import torch
    from safetensors.torch import save_file

    from engine.models.gguf_reader import gguf_config
    from engine.models.loader import load_weights
    from splitserve.default_model import ensure_default_model

    source = Path(gguf) if gguf is not None else ensure_default_model()
    stamp = f"{source.resolve()} {source.stat().st_size} {source.stat().st_mtime_ns}"
    marker = model_dir / _MARKER
    if marker.is_file() and marker.read_text().strip() == stamp:
        return model_dir
    config = gguf_config(str(source))
    weights = load_weights(str(source), torch.float32)
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    # rope_theta beside rope_parameters: older transformers (vLLM's venv) read only the former.
    config |= {"rope_theta": config["rope_parameters"]["rope_theta"], "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    marker.write_text(stamp + "\n")
    return model_dir
