"""Conversations to prompts with a model's chat template (torch-free: the gateway uses it).

``ChatTemplate.of(tokenizer)`` is None for a model without a template. ``render`` opens the
assistant's turn after the messages and returns token ids. ``end_of_turn_ids`` are found by
rendering a finished assistant turn and taking the special token the template writes right
after its content (``<|im_end|>``, ``<|eot_id|>``, ``</s>``...): generation stops there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = ("system", "user", "assistant")
_SENTINEL = "\u2063splitserve-end-of-turn-probe\u2063"


def _special_ids(tokenizer: Any) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i, token in added.items() if getattr(token, "special", False)}
    return ids | set(getattr(tokenizer, "all_special_ids", []) or [])


def _find_end_of_turn(tokenizer: Any) -> tuple[int, ...]:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    _, found, after = text.partition(_SENTINEL)
    if not found:
        return ()
    ids = tokenizer.encode(after, add_special_tokens=False)
    if ids and ids[0] in _special_ids(tokenizer):
        return (int(ids[0]),)
    return ()


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer with a chat template, and the token that ends an assistant turn."""

    tokenizer: Any
    end_of_turn_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any | None) -> ChatTemplate | None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return None
        return cls(tokenizer, _find_end_of_turn(tokenizer))

    def render(self, messages: Sequence[tuple[str, str]], field: str = "messages") -> list[int]:
        """Token ids of ``(role, content)`` turns followed by the opened assistant turn.
        Raises ``ValueError`` naming ``field`` for an empty conversation or unknown role."""
        if not messages:
            raise ValueError(f"{field} must hold at least one message")
        for i, (role, _) in enumerate(messages):
            if role not in CHAT_ROLES:
                raise ValueError(f"{field}[{i}].role must be one of {CHAT_ROLES}, got {role!r}")
        turns = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens itself; adding BOS again would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))
