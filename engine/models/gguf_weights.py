"""A GGUF file's tensors as the Hugging Face-named, dequantized weights our forward takes.

Three differences from a HF checkpoint are undone here:

* names: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (table below);
* quantization: each tensor is dequantized into float32, then cast to the engine's dtype:
  Q8_0, Q4_0 and Q4_1 (the default model's types) by :func:`dequantize_blocks` in whole-tensor
  torch ops, bit for bit what the ``gguf`` package's numpy reference gives (tested) in about a
  tenth of its time, the other types by that reference;
* RoPE layout (``llama`` files only): llama.cpp's converter permutes the rows of q_proj and
  k_proj (weights and biases) of each head from the "rotate half" order transformers uses,
  ``[x0 .. x(d/2-1) | x(d/2) .. x(d-1)]``, to the interleaved order its RoPE kernel rotates,
  ``[x0, x(d/2), x1, x(d/2+1), ...]``. Our forward is rotate-half, so the rows go back:
  per head, row ``2*i + s`` of the file is row ``s*d/2 + i`` of the original.
  (``qwen2``/``qwen3`` files are written unpermuted: llama.cpp rotates them NeoX-style.)

GGUF lists a tensor's dimensions innermost first (``[in_features, out_features]``); the
reader's arrays are already row-major ``[out_features, in_features]``, as torch wants.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from engine.models.gguf_reader import GGUFFile, gguf_config, open_gguf
from engine.quant.linear import BlockWeight

# Tensor types this loader reads; each is covered by tests/engine/test_gguf_loader.py.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The transformers name of a GGUF tensor; an unknown tensor is an error, not skipped."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"model: GGUF tensor {gguf_name!r} is not part of a supported architecture")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (weights [out, in] or biases [out])."""
    half = rows.shape[0] // num_heads // 2
    grouped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def check_tensor_types(gf: GGUFFile) -> None:
    """Fail before dequantizing anything when a tensor's type is not one we read."""
    for tensor in gf.reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"model: GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which this "
                f"loader cannot read; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )


def dequantize(tensor: object) -> np.ndarray:
    """One reader tensor as float32, shaped row-major as transformers names it."""
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type  # type: ignore[attr-defined]
    data = tensor.data  # type: ignore[attr-defined]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.array(data, dtype=np.float32)  # a copy: never a view of the memory map
    elif qtype.name in BLOCK_BYTES:
        values = dequantize_blocks(np.array(data), qtype.name).numpy()
    else:
        values = quants.dequantize(data, qtype)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # type: ignore[attr-defined]
    return values.reshape(shape)


# Bytes of one block of 32 weights: a float16 scale (Q4_1: and a float16 min), then the values.
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize_blocks(data: np.ndarray, qtype: str) -> torch.Tensor:  # uint8 [..., row bytes] -> float32 [n]
    """llama.cpp's Q8_0 (``d * q``, q int8), Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) blocks
    as float32, in the reference's order of operations (a product, then a sum: no FMA); 4-bit
    values are the low nibbles of the 16 bytes (weights 0-15), then the high ones (16-31)."""
    blocks = torch.from_numpy(data.reshape(-1, BLOCK_BYTES[qtype]))
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * scale).flatten()
    packed = blocks[:, 4:] if qtype == "Q4_1" else blocks[:, 2:]
    values = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
    if qtype == "Q4_0":
        return (scale * (values - 8)).flatten()
    return (scale * values + blocks[:, 2:4].contiguous().view(torch.float16).float()).flatten()


def load_gguf_weights(
    path: str, dtype: torch.dtype, keep: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor | BlockWeight]:
    """Every tensor of the file, renamed, dequantized, q/k rows restored, cast to ``dtype``;
    a tensor whose type is in ``keep`` (Q8_0, Q4_1) stays in its blocks, a
    :class:`BlockWeight` (its rows restored the same way)."""
    gf = open_gguf(path)
    config = gguf_config(path)  # checks the architecture first
    check_tensor_types(gf)
    permuted = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, torch.Tensor | BlockWeight] = {}
    for tensor in gf.reader.tensors:
        name = hf_name(tensor.name)
        kept = tensor.tensor_type.name in keep and len(tensor.shape) == 2
        values = _block_rows(tensor) if kept else dequantize(tensor)
        proj = name.split(".")[-2]
        if gf.architecture == "llama" and proj in permuted:
            values = unpermute_rope_rows(values, permuted[proj])
        if kept:
            in_features = int(tensor.shape[0])
            weights[name] = BlockWeight(tensor.tensor_type.name, torch.from_numpy(values), in_features)
        else:
            weights[name] = torch.from_numpy(values).to(dtype)
    return weights


def _block_rows(tensor: object) -> np.ndarray:  # uint8 [out_features, row bytes], a copy
    rows = int(tensor.shape[1])  # type: ignore[attr-defined]
    return np.array(tensor.data, dtype=np.uint8).reshape(rows, -1)  # type: ignore[attr-defined]
