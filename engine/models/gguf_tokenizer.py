"""A GGUF file's tokenizer, built with the ``tokenizers`` library, without torch.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``,
already spelled in the byte-level alphabet for BPE vocabularies), the merges, each token's
type (3 = control, 4 = user-defined), the special token ids, the BOS/EOS flags and the chat
template. ``tokenizer.ggml.pre`` names how llama.cpp splits text before BPE; we rebuild
exactly the splits we have checked against llama.cpp's definitions and refuse the rest
(a wrong split gives wrong token ids, silently).

(``transformers`` can also build this tokenizer, but its GGUF path imports torch, and the
gateway must not.)
"""

from __future__ import annotations

from typing import Any

from engine.models.gguf_reader import GGUFFile, open_gguf

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)  # byte-level BPE
# tokenizer.ggml.pre -> does it isolate every digit before the GPT-2 split (llama.cpp:
# "\p{N}" then the GPT-2 regex for smollm and its kin; the GPT-2 regex alone for gpt2).
SUPPORTED_PRE_TOKENIZERS = {"gpt2": False, "smollm": True}
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(gf: GGUFFile) -> Any:
    from tokenizers import pre_tokenizers

    pre = str(gf.metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(
            f"model: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if not SUPPORTED_PRE_TOKENIZERS[pre]:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def _special_token(gf: GGUFFile, tokens: list[str], name: str) -> str | None:
    token_id = gf.metadata.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ValueError(f"model: tokenizer.ggml.{name}_token_id={token_id} is outside the vocabulary")
    return tokens[int(token_id)]


def _post_processor(gf: GGUFFile, bos: str | None, eos: str | None) -> Any:
    """BOS/EOS added to every encoded text, as the file's add_bos/add_eos flags say."""
    from tokenizers import processors

    add_bos = bool(gf.metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(gf.metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return None
    head = [bos] if add_bos else []
    tail = [eos] if add_eos else []
    single = [*head, "$A", *tail]
    pair = [*single, *head, "$B:1", *tail]
    tokens = gf.metadata["tokenizer.ggml.tokens"]
    special = [(t, tokens.index(t)) for t in dict.fromkeys([*head, *tail])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _backend(gf: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    merges = gf.metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("model: GGUF file has no tokenizer.ggml.merges (needed for a BPE vocabulary)")
    pre_tokenizer = _pre_tokenizer(gf)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # tokenizers panics (an uncatchable-looking PanicException) on a merge outside the vocabulary.
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2 or "".join(p) not in vocab
                or p[0] not in vocab or p[1] not in vocab), None)
    if bad is not None:
        raise ValueError(f"model: GGUF merge {bad!r} (tokenizer.ggml.merges) joins tokens outside the vocabulary")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    types = list(gf.metadata.get("tokenizer.ggml.token_type") or [])
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    # Already in the vocabulary: adding them only makes the splitter keep them whole.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def gguf_tokenizer(path: str) -> Any | None:
    """The file's tokenizer as a ``PreTrainedTokenizerFast`` (chat template included), or
    None when the file describes none (token ids only, like a checkpoint without one)."""
    gf = open_gguf(path)
    if "tokenizer.ggml.model" not in gf.metadata:
        return None
    model = str(gf.metadata["tokenizer.ggml.model"])
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"model: GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens = list(gf.metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("model: GGUF file has no tokenizer.ggml.tokens")
    backend = _backend(gf, tokens)
    special = {name: _special_token(gf, tokens, name) for name in ("bos", "eos", "unknown", "padding")}
    post = _post_processor(gf, special["bos"], special["eos"])
    if post is not None:
        backend.post_processor = post
    # The fast-tokenizer class wraps a tokenizers.Tokenizer without importing torch.
    from transformers import PreTrainedTokenizerFast

    kwargs = {"bos_token": special["bos"], "eos_token": special["eos"],
              "unk_token": special["unknown"], "pad_token": special["padding"]}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=gf.metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(gf.arch_key("context_length", 0)) or None,
        **{k: v for k, v in kwargs.items() if v is not None},
    )
