"""Speculative-decoding counters: how many tokens were drafted, and how many the target accepted.

Vocabulary as in ``engine.spec_decode.rejection_sampler``. A *draft* here is one row's proposal in
one step (rows with no draft tokens that step are not counted).
"""

from __future__ import annotations

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
        num_draft_tokens: torch.Tensor,  # [num_rows] int64
        num_accepted: torch.Tensor,  # [num_rows] int64, 0..num_draft_tokens[i]
    ) -> None:
        """Add one step (``RejectionOutput.num_accepted`` and the ``num_draft_tokens`` verified)."""
        if num_draft_tokens.dim() != 1 or num_accepted.shape != num_draft_tokens.shape:
            raise ValueError(
                f"num_draft_tokens and num_accepted must both be [num_rows], got "
                f"{tuple(num_draft_tokens.shape)} and {tuple(num_accepted.shape)}"
            )
        num_draft_tokens, num_accepted = num_draft_tokens.long().cpu(), num_accepted.long().cpu()
        if bool(((num_accepted < 0) | (num_accepted > num_draft_tokens)).any()):
            raise ValueError("num_accepted must lie in [0, num_draft_tokens] in every row")
        # count[n]: rows with exactly n accepted; position j was accepted in rows with n > j.
        count = torch.bincount(num_accepted)  # [max accepted + 1]
        accepted_at = count.flip(0).cumsum(0).flip(0)[1:].tolist()  # [max accepted]
        if len(accepted_at) > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (len(accepted_at) - len(self.accepted_per_position))
        for position, num in enumerate(accepted_at):
            self.accepted_per_position[position] += num
        self.num_drafts += int((num_draft_tokens > 0).sum())
        self.num_draft_tokens += int(num_draft_tokens.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
