"""GGUF checkpoints (llama.cpp's single-file format): open one, and state what it holds as
the ``config.json`` dict our ``ModelSpec`` is built from.

Torch-free on purpose, like ``engine.models.spec``: the gateway reads a GGUF file's facts
and tokenizer through here. The file is read with the ``gguf`` package (the format's own
reader, from the llama.cpp project; numpy only). Tensors: ``engine.models.gguf_weights``;
tokenizer: ``engine.models.gguf_tokenizer``.

A file is opened once per (path, size, mtime): parsing the header of a real checkpoint
(its vocabulary and merges are ~100k array items) takes a second or two, and the spec,
the tokenizer and the weights are read from the same file in turn. The reader parses a plain
ndarray view of its memory map (:func:`_reader_class`), a third of the time gguf's own takes.
"""

from __future__ import annotations

import functools
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GGUF ``general.architecture`` -> the transformers architecture our forward implements it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 1/2, Mistral (converted as llama), SmolLM
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# model_type of each, for transformers' config classes (``engine.models.loader``).
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Tokens that end a generation in llama.cpp's vocabulary metadata, besides EOS.
_END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def is_gguf(path: str) -> bool:
    """True when ``path`` names a GGUF file (by its suffix; a directory is a HF checkpoint)."""
    return str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its metadata as Python values and the reader (tensors, memory-mapped)."""

    path: str
    metadata: dict[str, Any]
    reader: Any  # gguf.GGUFReader

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def arch_key(self, name: str, default: Any = None) -> Any:
        """``{architecture}.{name}``; a missing key without a default is a clear error."""
        key = f"{self.architecture}.{name}"
        if key in self.metadata:
            return self.metadata[key]
        if default is None:
            raise ValueError(f"model: GGUF file {self.path!r} has no metadata key {key!r}")
        return default


# What a damaged or foreign file makes the reader raise (bad magic: ValueError; a header
# cut short: IndexError/ValueError from numpy; an unknown enum value: ValueError).
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError, EOFError, struct.error)


@functools.cache
def _reader_class() -> type:
    """gguf's ``GGUFReader`` over a plain ndarray view of the file's memory map: the same bytes
    (still mapped, not read), the same fields and tensors, parsed in a third of the time
    (measured 7.5 s against 23 s on the default model at load 12). Each field is a slice of
    ``reader.data``; a slice of an ``np.memmap`` runs memmap's ``__array_finalize__`` in
    Python, ~100k times for a 49k-token vocabulary, a slice of an ndarray does not."""
    import numpy as np
    from gguf import GGUFReader

    class PlainMapReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)  # the memmap stays alive as its base

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            parts = _array_parts(self, orig_offs, raw_type)
            return parts if parts is not None else super()._get_field_parts(orig_offs, raw_type)

    return PlainMapReader


def _array_parts(reader: Any, offs: int, raw_type: int) -> tuple[int, list, list[int], list] | None:
    """A little-endian array of numbers or strings as gguf's ``_get_field_parts`` gives it
    (its size, parts, data indices and types; ``contents()`` reads them the same), parsed
    without gguf's per-item calls: the vocabulary and merges (~100k strings) took 0.6 s of
    CPU in each of ``up``'s three processes, 0.1 s this way. None: gguf's own path."""
    import numpy as np
    from gguf import GGUFValueType

    if raw_type != GGUFValueType.ARRAY or reader.byte_order != "I" or sys.byteorder != "little":
        return None
    raw_itype, alen = reader._get(offs, np.uint32), reader._get(offs + 4, np.uint64)
    item, count, start = GGUFValueType(raw_itype[0]), int(alen[0]), offs + 12
    head = [raw_itype, alen]
    nptype = reader.gguf_scalar_to_np.get(item)
    types = [GGUFValueType.ARRAY, item] if count else [GGUFValueType.ARRAY]
    if nptype is not None:  # one part per value, a view of one read
        values = reader._get(start, nptype, count)
        if values.size != count:
            raise ValueError(f"GGUF array at offset {offs} runs past the end of the file")
        return 12 + int(values.nbytes), [*head, *values.reshape(count, 1)], list(range(2, 2 + count)), types
    if item != GGUFValueType.STRING:
        return None
    data, u64, at, parts = reader.data, np.dtype(np.uint64), start, head
    length = struct.Struct("<Q").unpack_from
    for _ in range(count):  # each string: its uint64 length, then its bytes (two parts, as gguf's)
        (n,) = length(data, at)
        parts += [data[at:at + 8].view(u64), data[at + 8:at + 8 + n]]
        at += 8 + n
    if at > data.size:
        raise ValueError(f"GGUF string array at offset {offs} runs past the end of the file")
    return at - offs, parts, list(range(3, 3 + 2 * count, 2)), types


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        reader = _reader_class()(path, "r")
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except _READ_ERRORS as exc:
        raise ValueError(f"model: {path!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    if end > size:
        raise ValueError(f"model: GGUF file {path!r} is truncated: its tensors need {end} bytes, it has {size}")
    return GGUFFile(path, metadata, reader)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file at ``path`` (cached while the file is unchanged)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"model: {path!r} is not a file")
    st = p.stat()
    return _open(str(p.resolve()), st.st_size, st.st_mtime_ns)


def _check_architecture(gf: GGUFFile) -> str:
    arch = gf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"model: unsupported GGUF architecture {arch!r} in {gf.path!r}; "
            f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    if gf.arch_key("expert_count", 0):
        raise ValueError(f"model: {gf.path!r} is a mixture-of-experts {arch!r} model; not supported")
    return arch


def _rope_parameters(gf: GGUFFile, head_dim: int) -> dict[str, Any]:
    rope_dim = int(gf.arch_key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"model: partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    if "rope_freqs.weight" in gf.tensor_names():
        raise ValueError("model: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) "
                         "are not supported in GGUF files")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(gf.arch_key("rope.freq_base", 10000.0))}
    scaling = str(gf.arch_key("rope.scaling.type", "none"))
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(gf.arch_key("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"model: GGUF RoPE scaling {scaling!r} is not supported; supported: none, linear")
    return params


def _embedding_rows(gf: GGUFFile) -> int:
    for tensor in gf.reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dimensions innermost first
    raise ValueError(f"model: GGUF file {gf.path!r} has no token_embd.weight tensor")


def _end_token_ids(gf: GGUFFile) -> list[int]:
    ids = [int(gf.metadata[k]) for k in _END_TOKEN_KEYS if k in gf.metadata]
    return list(dict.fromkeys(ids))


def gguf_config(path: str) -> dict[str, Any]:
    """The file's metadata as a ``config.json`` dict (architecture checked), the input of
    ``engine.models.spec.model_spec_from_config`` and of transformers' config classes."""
    gf = open_gguf(path)
    arch = _check_architecture(gf)
    hidden = int(gf.arch_key("embedding_length"))
    num_heads = int(gf.arch_key("attention.head_count"))
    head_dim = int(gf.arch_key("attention.key_length", hidden // num_heads))
    names = set(gf.tensor_names())
    bos = gf.metadata.get("tokenizer.ggml.bos_token_id")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": GGUF_MODEL_TYPES[arch],
        "vocab_size": _embedding_rows(gf),
        "hidden_size": hidden,
        "num_hidden_layers": int(gf.arch_key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gf.arch_key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "intermediate_size": int(gf.arch_key("feed_forward_length")),
        "rms_norm_eps": float(gf.arch_key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(gf.arch_key("context_length")),
        "rope_parameters": _rope_parameters(gf, head_dim),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": _end_token_ids(gf),
    }
