"""Speculative-decoding counters: how many tokens were drafted, and how many the target accepted.

Vocabulary as in ``engine.spec_decode.rejection_sampler``. A *draft* here is one row's proposal in
one step (rows with no draft tokens that step are not counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SpecDecodeStats"]


@dataclass
class SpecDecodeStats:
    """Running totals over verification steps; ``observe`` adds one step. Owned by one caller."""

    num_drafts: int = 0  # row-steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: drafts whose token at position j was accepted (so those at 0..j-1 were too).
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per draft: the accepted ones plus the recovered or bonus token.

        1.0 before any draft."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the draft tokens (0.0 before any)."""
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    def observe(
        self,
        num_draft_tokens: torch.Tensor | Sequence[int],  # [num_rows] int
        num_accepted: torch.Tensor | Sequence[int],  # [num_rows] int, 0..num_draft_tokens[i]
    ) -> None:
        """Add one step (``RejectionOutput.num_accepted`` and the ``num_draft_tokens`` verified).

        Host bookkeeping: tensors are read once with ``tolist``, lists are taken as they are."""
        drafts, accepted = _as_list(num_draft_tokens), _as_list(num_accepted)
        if drafts is None or accepted is None or len(drafts) != len(accepted):
            raise ValueError(
                "num_draft_tokens and num_accepted must both be [num_rows], got "
                f"{_shape(num_draft_tokens)} and {_shape(num_accepted)}"
            )
        if any(not 0 <= a <= d for d, a in zip(drafts, accepted)):
            raise ValueError("num_accepted must lie in [0, num_draft_tokens] in every row")
        longest = max(accepted, default=0)
        if longest > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (longest - len(self.accepted_per_position))
        for num in accepted:  # position j was accepted in every row with num > j
            for position in range(num):
                self.accepted_per_position[position] += 1
        self.num_drafts += sum(1 for d in drafts if d > 0)
        self.num_draft_tokens += sum(drafts)
        self.num_accepted_tokens += sum(accepted)


def _as_list(values: torch.Tensor | Sequence[int]) -> list[int] | None:
    """A 1-d tensor or a sequence of ints as a list; None for anything else."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()] if values.dim() == 1 else None
    return [int(v) for v in values]


def _shape(values: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    return tuple(values.shape) if isinstance(values, torch.Tensor) else (len(values),)
