"""Whether a prompt can run: the one prompt rule.

A prompt is at least one token, every id an integer in ``[0, vocab_size)``, and shorter than
``max_model_len`` (room for one output token); with ``max_new_tokens``, room for all of them.
Each rejection is a ``ValueError`` naming the caller's field, which the services turn into
INVALID_ARGUMENT. Called by the gateway (``gateway/validation.py``: the whole rule, with the
request's budget; ``gateway/prompt.py``: the length alone, before the ids are scanned), the
workers at their edge (``plumbing/engine_service.py``) and the engine's own entry points
(``Engine.add_request``, ``reserve_kv``, ``admit_prefilled``, which add the KV pool's size).
Imports nothing heavy: the gateway runs it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_prompt_len(num_tokens: int, max_model_len: int, field: str = "prompt") -> None:
    """A prompt of ``num_tokens`` tokens: not empty, and leaving room for one output token."""
    if num_tokens < 1:
        raise ValueError(f"{field} must not be empty")
    if num_tokens >= max_model_len:
        raise ValueError(f"{field} is {num_tokens} tokens; max_model_len={max_model_len} leaves no room for output")


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int, field: str = "prompt", *,
                 max_new_tokens: int | None = None, max_new_tokens_field: str = "max_tokens") -> None:
    """The whole rule (module docstring); ``max_new_tokens`` None: only one output token must fit."""
    check_prompt_len(len(token_ids), max_model_len, field)
    bad = next((i for i, t in enumerate(token_ids)
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}[{bad}]: {token_ids[bad]!r} is outside the vocabulary [0, {vocab_size})")
    budget = max_model_len - len(token_ids)
    if max_new_tokens is not None and max_new_tokens > budget:
        raise ValueError(f"{max_new_tokens_field}={max_new_tokens} exceeds what max_model_len={max_model_len} "
                         f"leaves after a {len(token_ids)}-token prompt ({budget})")
