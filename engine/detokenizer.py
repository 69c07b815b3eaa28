"""Incremental detokenization: turn a growing token list into text deltas.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and many tokenizers
change the text of earlier tokens depending on what follows (leading spaces). So each
step decodes a short window of recent tokens twice, with and without the new ones, and
emits the difference, holding back text that ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

# How many tokens before the unread ones give enough context to decode them.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly readable text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
