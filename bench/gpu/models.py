"""The checkpoints the GPU check runs on.

* ``random_checkpoint``: a seeded random Llama saved like a download (``bench.workload``'s
  maker), for the parity and hand-off steps, which load it the ordinary way.
* ``device_weights`` + ``weights_made_on_device``: the 8B-shaped model of the throughput
  step. Its 16 GB are drawn on the GPU itself, tensor by tensor, in the Hugging Face names
  the loader returns, and handed to the engine in place of ``load_weights`` (the directory
  holds only ``config.json``): writing 16 GB to disk and reading them back through the CPU
  would cost more of the run than the measurement.
* ``slice_gguf``: a small real-weights checkpoint cut from the SmolLM2 GGUF, which (98 MB)
  does not travel in the device's 64 MiB working tree: its first layers and the first rows
  of its vocabulary, dequantized and stored in bfloat16.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import torch

from bench.gpu.options import LlamaShape
from bench.workload import ModelShape, ensure_model

PARITY_INIT_RANGE = 0.15  # as the engine's parity tests: keeps random greedy logits apart


def random_checkpoint(model_dir: Path, shape: LlamaShape, seed: int,
                      init_range: float = PARITY_INIT_RANGE) -> Path:
    """A seeded random Llama (float32) in ``model_dir``, reused when shape and seed match."""
    return ensure_model(model_dir, ModelShape(**asdict(shape), initializer_range=init_range), seed)


def config_only_checkpoint(model_dir: Path, shape: LlamaShape) -> Path:
    """A directory with the model's ``config.json`` and no weights (see ``device_weights``)."""
    from transformers import LlamaConfig

    model_dir.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**asdict(shape), dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    return model_dir.resolve()


def device_weights(shape: LlamaShape, dtype: torch.dtype, device: torch.device, seed: int,
                   init_range: float = 0.02) -> dict[str, torch.Tensor]:
    """Every tensor of a random ``LlamaForCausalLM`` of ``shape``, made on ``device``:
    norms 1, everything else N(0, init_range). Names and shapes come from the model built on
    the meta device (no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**asdict(shape)))
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, param in meta.state_dict().items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            t = torch.empty(param.shape, dtype=dtype, device=device)
            weights[name] = t.normal_(0.0, init_range, generator=gen)
    return weights


@contextmanager
def weights_made_on_device(weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """While open, an engine built on a config-only checkpoint takes ``weights`` (once)."""
    def load(path: str, dtype: torch.dtype, keep: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        taken = dict(weights)
        weights.clear()  # the model pops what it uses: no second reference keeps 16 GB alive
        return {name: t.to(dtype) for name, t in taken.items()}

    with mock.patch("engine.model_runner.load_weights", load):
        yield


def weight_bytes_read_per_step(model_dir: Path, itemsize: int) -> int:
    """Bytes of weights a decode step reads: every matrix and norm but the embedding table
    (a step reads one row of it per token)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, heads, kv_heads = (cfg[k] for k in ("hidden_size", "intermediate_size",
                                                       "num_attention_heads", "num_key_value_heads"))
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter + 2 * hidden
    return itemsize * (cfg["num_hidden_layers"] * per_layer + hidden * cfg["vocab_size"] + hidden)


def slice_gguf(gguf_path: str, out_dir: Path, num_layers: int = 2, vocab_size: int = 4096) -> Path:
    """A checkpoint of the GGUF's first ``num_layers`` layers and ``vocab_size`` token rows."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from engine.models.gguf_reader import gguf_config
    from engine.models.gguf_weights import load_gguf_weights

    raw = dict(gguf_config(gguf_path))
    raw.update(num_hidden_layers=num_layers, vocab_size=vocab_size)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = raw.get(key)
        if isinstance(ids, list):
            raw[key] = [i for i in ids if i < vocab_size] or None
        elif ids is not None and ids >= vocab_size:
            raw[key] = None
    weights = {}
    for name, tensor in load_gguf_weights(gguf_path, torch.bfloat16).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[:vocab_size]
        weights[name] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(**raw).save_pretrained(out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "sliced_from.json").write_text(json.dumps(
        {"gguf": Path(gguf_path).name, "num_layers": num_layers, "vocab_size": vocab_size,
         "dtype": "bfloat16 (the file's Q4_1 weights, dequantized)"}, indent=1) + "\n")
    return out_dir.resolve()


def main() -> int:
    """``python -m bench.gpu.models GGUF OUT_DIR [LAYERS] [VOCAB]``: write the sliced checkpoint."""
    import sys

    args = sys.argv[1:]
    if len(args) < 2:
        sys.stderr.write("usage: python -m bench.gpu.models GGUF OUT_DIR [NUM_LAYERS] [VOCAB_SIZE]\n")
        return 2
    extra = [int(a) for a in args[2:4]]
    out = slice_gguf(args[0], Path(args[1]), *extra)
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
