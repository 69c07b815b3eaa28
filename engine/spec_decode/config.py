"""Speculative decoding configuration (server side; requests may lower k)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_model", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes draft tokens and when it speculates at all.

    ``num_speculative_tokens`` (k) is the server's proposal length; a request may ask for
    fewer through ``SamplingParams.num_speculative_tokens``. Back-off policy: a step
    speculates only while at most ``max_batch_size`` requests are decoding; beyond that the
    batch already keeps the matmuls busy, and k extra tokens per sequence cost about as
    much compute as they could save.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("draft_model: the draft_model method needs a checkpoint directory")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min/ngram_max must satisfy 1 <= min <= max, got {self.ngram_min}/{self.ngram_max}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
