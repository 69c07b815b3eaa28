"""Speculative decoding configuration (server side; requests may lower k)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_model", "ngram", "ngram_draft")
# Shortest recurring suffix that n-gram lookup trusts, when ``ngram_min`` is left unset:
# plain lookup takes any match; the combined method hands weak (1-2 token) matches to the
# draft model, whose proposals are accepted more often there.
DEFAULT_NGRAM_MIN = {"draft_model": 1, "ngram": 1, "ngram_draft": 3}
MAX_DRAFTS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes draft tokens and when it speculates at all.

    Methods: ``ngram`` (prompt lookup: the tokens that followed the last earlier occurrence
    of the sequence's suffix), ``draft_model`` (a small model with the target's tokenizer),
    ``ngram_draft`` (prompt lookup where a suffix of at least ``ngram_min`` tokens recurs,
    the draft model everywhere else).

    ``num_speculative_tokens`` (k) is the server's proposal length; a request may ask for
    fewer through ``SamplingParams.num_speculative_tokens``. ``ngram_min`` / ``ngram_max``
    bound the suffix lengths that lookup tries (longest first); ``ngram_min`` None means
    the method's default (``DEFAULT_NGRAM_MIN``), resolved in ``min_ngram_len``.
    ``num_lookup_tokens`` is the proposal length of prompt lookup where it differs from k:
    None means k for ``ngram`` and 2k (at most 16) for ``ngram_draft``, whose lookup drafts
    cost only their verification while each draft-model token costs a draft forward, so
    the combined method lets lookup run longer (``lookup_len``).

    Back-off policy: a step speculates only while at most ``max_batch_size`` requests are
    decoding; beyond that the batch already keeps the matmuls busy, and k extra tokens per
    sequence cost about as much compute as they could save.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int | None = None
    ngram_max: int = 4
    num_lookup_tokens: int | None = None
    max_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_DRAFTS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_DRAFTS}], got {self.num_speculative_tokens}"
            )
        if self.num_lookup_tokens is not None and not 1 <= self.num_lookup_tokens <= MAX_DRAFTS:
            raise ValueError(f"num_lookup_tokens must be in [1, {MAX_DRAFTS}], got {self.num_lookup_tokens}")
        if self.method in ("draft_model", "ngram_draft") and not self.draft_model:
            raise ValueError(f"draft_model: the {self.method} method needs a checkpoint directory")
        if not 1 <= self.min_ngram_len <= self.ngram_max:
            raise ValueError(
                f"ngram_min/ngram_max must satisfy 1 <= min <= max, got {self.min_ngram_len}/{self.ngram_max}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @property
    def lookup_len(self) -> int:
        """Drafts per step from prompt lookup (``num_lookup_tokens`` or the method's default)."""
        if self.num_lookup_tokens is not None:
            return self.num_lookup_tokens
        if self.method == "ngram_draft":
            return min(MAX_DRAFTS, 2 * self.num_speculative_tokens)
        return self.num_speculative_tokens

    @property
    def max_num_drafts(self) -> int:
        """The most drafts one request can get in a step (the engine reserves their slots)."""
        if self.method == "ngram":
            return self.lookup_len
        if self.method == "ngram_draft":
            return max(self.lookup_len, self.num_speculative_tokens)
        return self.num_speculative_tokens

    @property
    def min_ngram_len(self) -> int:
        """``ngram_min``, or the method's default when unset."""
        return self.ngram_min if self.ngram_min is not None else DEFAULT_NGRAM_MIN[self.method]
