"""The default model's corpus and tokenizer: the Python standard library's ``.py`` files,
split train / held-out by a hash of each path, and a byte-level BPE trained on them.
Used by ``tools/train_default_model.py``."""

from __future__ import annotations

import hashlib
import logging
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger("train_default_model")

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "ensurepip", "__pycache__"}
)
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")


# --------------------------------------------------------------------------- corpus


def list_corpus_files(stdlib_dir: Path) -> list[str]:
    """Sorted POSIX relative paths of the stdlib ``.py`` files we train on."""
    rel_paths = []
    for path in stdlib_dir.rglob("*.py"):
        rel = path.relative_to(stdlib_dir)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith(EXCLUDED_PREFIXES):
            continue
        rel_paths.append(rel.as_posix())
    return sorted(rel_paths)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """A fixed hashed selection: the same paths on every machine."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < heldout_percent


def read_texts(stdlib_dir: Path, rel_paths: list[str]) -> dict[str, str]:
    """Read files as UTF-8, skipping the few that are not valid UTF-8."""
    texts = {}
    for rel in rel_paths:
        try:
            texts[rel] = (stdlib_dir / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            logger.info("skipping non-UTF-8 file %s", rel)
    return texts


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with <pad>=0, <s>=1, </s>=2; encode() prepends <s>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    for token, token_id in ((PAD_TOKEN, PAD_ID), (BOS_TOKEN, BOS_ID), (EOS_TOKEN, EOS_ID)):
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {token_id}")
    return tokenizer


def pack(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One 1-D stream: <s> file </s> <s> file </s> ... (encode adds the <s>)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def to_hf_tokenizer(tokenizer: Tokenizer, context_len: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=context_len,
        clean_up_tokenization_spaces=False,
    )


def load_corpus(heldout_percent: int, max_train_files: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """(train, held-out) texts keyed by stdlib-relative path, in sorted path order."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = list_corpus_files(stdlib_dir)
    heldout_paths = [p for p in rel_paths if is_heldout(p, heldout_percent)]
    train_paths = [p for p in rel_paths if not is_heldout(p, heldout_percent)][: max_train_files]
    if max_train_files is not None:
        heldout_paths = heldout_paths[: max(1, max_train_files // 4)]
    train_texts = read_texts(stdlib_dir, train_paths)
    heldout_texts = read_texts(stdlib_dir, heldout_paths)
    logger.info("corpus: %d train files, %d held-out files", len(train_texts), len(heldout_texts))
    return train_texts, heldout_texts
