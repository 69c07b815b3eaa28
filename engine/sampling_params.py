"""Per-request sampling and stopping parameters (validated once, at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.constraints import Constraint

# Caps that keep one request from hurting the batch; the services expose the same limits.
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Order of logit processing (as in Hugging Face ``generate``): repetition penalty,
    temperature, top-k, top-p, min-p. ``temperature == 0`` means greedy (the other sampling
    knobs are then ignored). ``logprobs`` are taken from the raw model distribution
    (``log_softmax`` of the unprocessed logits), for the chosen token and, when
    ``logprobs=n > 0``, the n most likely alternatives.

    A request with ``seed`` set draws from its own generator, so it yields the same tokens
    whether it runs alone or in any batch wherever its logits are the same bits in both: always
    with ``EngineConfig.batch_invariant``, else up to near-ties of its draws
    (docs/architecture.md, "Batch invariance").
    """

    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    top_p: float = 1.0  # in (0, 1]; 1.0: disabled
    min_p: float = 0.0  # in [0, 1]; 0.0: disabled
    repetition_penalty: float = 1.0  # > 0; 1.0: disabled
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: chosen token only; n: + top-n
    # Speculative decoding: at most this many draft tokens per step (None: the server's k;
    # 0: never speculate for this request). Capped by the server's k.
    num_speculative_tokens: int | None = None
    # Structured output: what the reply must match (engine/constraints.py); None: free text.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens!r}"
            )
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
        if self.constraint is not None and self.min_tokens > 0:
            # EOS banned while the grammar may allow nothing else would leave no token at all.
            raise ValueError("min_tokens cannot be combined with a constraint")
        stop_ids = tuple(self.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(
            not isinstance(t, int) or t < 0 for t in stop_ids
        ):
            raise ValueError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} non-negative integers"
            )
        object.__setattr__(self, "stop_token_ids", stop_ids)

    def for_prefill(self) -> SamplingParams:
        """What a prefill worker runs for these params: the first token only (``max_tokens``
        1, ``min_tokens`` capped at 1), all else unchanged, so its first token is the one an
        in-process run would produce (same logit processing, same seeded draw)."""
        return replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
