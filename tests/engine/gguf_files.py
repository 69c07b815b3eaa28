"""Small GGUF files for the loader tests, written with the ``gguf`` package.

* ``encode_blocks(qtype, rng, num_blocks)``: random quantized blocks packed by hand from the
  ggml block layouts, with the float values they stand for computed here element by element
  (an independent reference for the loader's dequantization);
* ``checkpoint_to_gguf(src, dst, ...)``: a Hugging Face checkpoint directory (weights, and
  its tokenizer.json when there is one) written as llama.cpp's converter would, q/k rows of
  ``llama`` files permuted into llama.cpp's interleaved RoPE order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# -- hand-packed blocks -------------------------------------------------------------------
def _f16(rng: np.random.Generator, n: int, lo: float = 0.01, hi: float = 0.1) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16)


def _q8_0(rng: np.random.Generator) -> tuple[bytes, list[float]]:
    d = _f16(rng, 1)
    q = rng.integers(-128, 128, 32).astype(np.int8)
    return d.tobytes() + q.tobytes(), [float(np.float32(d[0]) * np.float32(v)) for v in q]


def _q4(rng: np.random.Generator, with_min: bool) -> tuple[bytes, list[float]]:
    d, m = _f16(rng, 1), _f16(rng, 1, -0.5, 0.5)
    q = rng.integers(0, 16, 32)
    packed = bytes(int(q[j]) | int(q[j + 16]) << 4 for j in range(16))
    dd, mm = np.float32(d[0]), np.float32(m[0])
    if with_min:  # Q4_1: d * q + m
        return d.tobytes() + m.tobytes() + packed, [float(dd * np.float32(v) + mm) for v in q]
    return d.tobytes() + packed, [float(dd * np.float32(int(v) - 8)) for v in q]  # Q4_0


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """Eight 6-bit scales and mins in 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (scales) and 4-7 (mins); sub-blocks 4-7 split into a low nibble in bytes 8-11 and
    their top two bits in the high bits of bytes 0-7."""
    out = [0] * 12
    for j in range(4):
        out[j] = int(sc[j]) | (int(sc[j + 4]) >> 4) << 6
        out[j + 4] = int(mn[j]) | (int(mn[j + 4]) >> 4) << 6
        out[j + 8] = (int(sc[j + 4]) & 15) | (int(mn[j + 4]) & 15) << 4
    return bytes(out)


def _q45_k(rng: np.random.Generator, five_bit: bool) -> tuple[bytes, list[float]]:
    """Q4_K / Q5_K: 256 values in 8 sub-blocks of 32, value = d*scale*q - dmin*min."""
    d, dmin = _f16(rng, 1), _f16(rng, 1)
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 32 if five_bit else 16, 256)
    qs, qh = bytearray(128), bytearray(32)
    for chunk in range(4):  # 64 values: low nibbles, then high nibbles of 32 bytes
        for i in range(32):
            lo, hi = int(q[64 * chunk + i]), int(q[64 * chunk + 32 + i])
            qs[32 * chunk + i] = (lo & 15) | (hi & 15) << 4
            qh[i] |= (lo >> 4) << (2 * chunk) | (hi >> 4) << (2 * chunk + 1)
    values = []
    for k in range(256):
        sub = k // 32
        scale = np.float32(d[0]) * np.float32(sc[sub])
        offset = np.float32(dmin[0]) * np.float32(mn[sub])
        values.append(float(scale * np.float32(q[k]) - offset))
    head = d.tobytes() + dmin.tobytes() + _k_scales(sc, mn)
    return head + (bytes(qh) if five_bit else b"") + bytes(qs), values


def _q6_k(rng: np.random.Generator) -> tuple[bytes, list[float]]:
    """Q6_K: 256 6-bit values (stored q + 32) in 16 sub-blocks of 16 with int8 scales."""
    d = _f16(rng, 1, 0.001, 0.01)
    sc = rng.integers(-128, 128, 16).astype(np.int8)
    q = rng.integers(0, 64, 256)
    ql, qh = bytearray(128), bytearray(64)
    for half in range(2):  # 128 values each: 4 runs of 32 sharing 32 qh bytes
        for i in range(32):
            a, b, c, e = (int(q[128 * half + 32 * r + i]) for r in range(4))
            ql[64 * half + i] = (a & 15) | (c & 15) << 4
            ql[64 * half + 32 + i] = (b & 15) | (e & 15) << 4
            qh[32 * half + i] = a >> 4 | (b >> 4) << 2 | (c >> 4) << 4 | (e >> 4) << 6
    values = [float(np.float32(d[0]) * np.float32(sc[k // 16]) * np.float32(int(q[k]) - 32)) for k in range(256)]
    return bytes(ql) + bytes(qh) + sc.tobytes() + d.tobytes(), values


ENCODERS: dict[str, Callable[[np.random.Generator], tuple[bytes, list[float]]]] = {
    "Q8_0": _q8_0,
    "Q4_0": lambda rng: _q4(rng, with_min=False),
    "Q4_1": lambda rng: _q4(rng, with_min=True),
    "Q4_K": lambda rng: _q45_k(rng, five_bit=False),
    "Q5_K": lambda rng: _q45_k(rng, five_bit=True),
    "Q6_K": _q6_k,
}


def encode_blocks(qtype: str, rng: np.random.Generator, rows: int, blocks_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """``(raw uint8 [rows, bytes_per_row], expected float32 [rows, values_per_row])``."""
    raw, values = [], []
    for _ in range(rows * blocks_per_row):
        block, vals = ENCODERS[qtype](rng)
        raw.append(np.frombuffer(block, dtype=np.uint8))
        values.extend(vals)
    return (np.concatenate(raw).reshape(rows, -1), np.asarray(values, dtype=np.float32).reshape(rows, -1))


# -- whole checkpoints --------------------------------------------------------------------
def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rotate-half row order -> interleaved pairs."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensor_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _add_tokenizer(writer: object, src: Path, chat_template: str | None) -> None:
    data = json.loads((src / "tokenizer.json").read_text())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    w = writer
    w.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    w.add_tokenizer_pre("gpt2")  # type: ignore[attr-defined]
    w.add_token_list(tokens)  # type: ignore[attr-defined]
    w.add_token_types([3 if t in special else 1 for t in tokens])  # type: ignore[attr-defined]
    w.add_token_merges(merges)  # type: ignore[attr-defined]
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])  # type: ignore[attr-defined]
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])  # type: ignore[attr-defined]
    w.add_add_bos_token(True)  # type: ignore[attr-defined]
    w.add_add_eos_token(False)  # type: ignore[attr-defined]
    if chat_template is not None:
        w.add_chat_template(chat_template)  # type: ignore[attr-defined]


def _add_config(w: object, cfg: dict, arch: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    w.add_context_length(cfg["max_position_embeddings"])  # type: ignore[attr-defined]
    w.add_embedding_length(cfg["hidden_size"])  # type: ignore[attr-defined]
    w.add_block_count(cfg["num_hidden_layers"])  # type: ignore[attr-defined]
    w.add_feed_forward_length(cfg["intermediate_size"])  # type: ignore[attr-defined]
    w.add_head_count(heads)  # type: ignore[attr-defined]
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)  # type: ignore[attr-defined]
    w.add_rope_dimension_count(head_dim)  # type: ignore[attr-defined]
    w.add_rope_freq_base(float(rope["rope_theta"]))  # type: ignore[attr-defined]
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))  # type: ignore[attr-defined]
    w.add_vocab_size(cfg["vocab_size"])  # type: ignore[attr-defined]
    if rope.get("rope_type") == "linear":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # type: ignore[attr-defined]
        w.add_rope_scaling_factor(float(rope["factor"]))  # type: ignore[attr-defined]
    if arch == "qwen3":
        w.add_key_length(head_dim)  # type: ignore[attr-defined]
        w.add_value_length(head_dim)  # type: ignore[attr-defined]


def checkpoint_to_gguf(src: Path, dst: Path, qtype: str = "F32", chat_template: str | None = None) -> Path:
    """Write the checkpoint at ``src`` as a GGUF file; 2-D weights in ``qtype`` (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1), 1-D tensors in F32."""
    import gguf
    import torch  # safetensors' numpy loader cannot read bfloat16 files
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    writer = gguf.GGUFWriter(str(dst), arch)
    _add_config(writer, cfg, arch)
    if (src / "tokenizer.json").is_file():
        _add_tokenizer(writer, src, chat_template)
    else:  # token ids only
        if cfg.get("bos_token_id") is not None:
            writer.add_bos_token_id(cfg["bos_token_id"])
        if cfg.get("eos_token_id") is not None:
            writer.add_eos_token_id(cfg["eos_token_id"])
    heads = {"attn_q": cfg["num_attention_heads"],
             "attn_k": cfg.get("num_key_value_heads") or cfg["num_attention_heads"]}
    for hf, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name = gguf_tensor_name(hf)
        values = tensor.to(torch.float32).numpy()
        part = name.split(".")[-2]
        if arch == "llama" and part in heads:
            values = llama_cpp_permute(values, heads[part])
        _add_tensor(writer, name, values, qtype if values.ndim == 2 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _add_tensor(writer: object, name: str, values: np.ndarray, qtype: str) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))  # type: ignore[attr-defined]
    elif qtype == "F16":
        writer.add_tensor(name, values.astype(np.float16))  # type: ignore[attr-defined]
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)  # type: ignore[attr-defined]


def write_tensors(dst: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama") -> Path:
    """A GGUF file holding only the given tensors (raw uint8 blocks, or floats for F32/F16)."""
    import gguf

    writer = gguf.GGUFWriter(str(dst), arch)
    for name, (data, qtype) in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def write_vocabulary(dst: Path, pre: str, tokens: list[str], merges: list[str]) -> Path:
    """A GGUF file with nothing but a byte-level BPE vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(dst), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
