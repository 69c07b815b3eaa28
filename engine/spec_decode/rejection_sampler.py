"""Batched speculative-decoding verifier: keep the drafts the target agrees with, add one token.

Glossary (the spec-decode vocabulary, used with these meanings everywhere):

* **draft** tokens: the up to k tokens a cheap proposer guesses for row i,
  ``draft_token_ids[i, :k]``.
  ``draft_probs`` is the distribution each one was sampled from (a small model's); None when the
  proposer is deterministic (n-gram lookup), which amounts to probability 1 on the proposed token.
* **target**: the model being served. One forward over the row's last token and its drafts gives
  ``target_probs``, its processed distribution (``engine.sampler.compute_probs``) at each of the k
  draft positions and at one position more.
* **accepted** tokens: the longest prefix of the drafts that the verifier keeps. They are emitted as
  if the target had produced them.
* **recovered** token: at the first rejected position j the verifier emits a token of its own in
  place of draft j: the target argmax (greedy rows), or a draw from the residual
  ``normalise(max(0, target_probs[j] - draft_probs[j]))`` (sampling rows).
* **bonus** token: when all k drafts are accepted, one more token from ``target_probs[k]``; it is
  free, since the target already scored that position.

Every row emits ``num_accepted + 1`` tokens: its accepted drafts, then exactly one recovered or
bonus token. A row with k = 0 (not speculating this step) emits just the bonus token, which is what
the plain sampler would have drawn. One row, k = 4, two drafts accepted::

    position            0     1     2     3     4
    draft_token_ids     d0    d1    d2    d3    .
    accepted            yes   yes   no    .     .     (nothing after the first rejection counts)
    output_token_ids    d0    d1    r2    -1    -1    r2: recovered at position 2

Greedy rows accept draft j when it is the target argmax at j, so their output is exactly what plain
greedy decoding would produce. Sampling rows follow Leviathan et al. 2023 / Chen et al. 2023:
accept draft x_j with probability ``min(1, target_probs[j, x_j] / draft_probs[j, x_j])``. Writing
t = target_probs[j], d = draft_probs[j], the token emitted at j is x with probability
``min(d(x), t(x)) + (1 - sum_y min(d(y), t(y))) * max(0, t(x) - d(x)) / sum_y max(0, t(y) - d(y))``
= ``t(x)``, because both sums equal the total variation distance between t and d. So the output
is distributed as the target's own samples, whatever the draft.

Random numbers: rows with a generator (seeded requests) draw their uniforms (one per draft token)
and then their recovered or bonus token from it, so their output does not depend on the rest of
the batch; all other rows draw from the default generator in one call. Greedy rows draw nothing of
their own. Categorical draws use the sampler's exponential race (``random_sample``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import random_sample

__all__ = ["PADDING_TOKEN_ID", "RejectionOutput", "greedy_verify", "rejection_sample"]

PADDING_TOKEN_ID = -1  # fills output_token_ids after each row's last emitted token


@dataclass
class RejectionOutput:
    """One verification step. Row i emitted ``output_token_ids[i, :num_output[i]]``."""

    output_token_ids: torch.Tensor  # [num_rows, max_k + 1] int64, PADDING_TOKEN_ID-padded
    num_accepted: torch.Tensor  # [num_rows] int64, accepted draft tokens, 0..num_draft_tokens[i]
    num_output: torch.Tensor  # [num_rows] int64, num_accepted + 1 (the recovered or bonus token)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_rows, max_k] int64; beyond num_draft_tokens[i]: ignored
    num_draft_tokens: torch.Tensor,  # [num_rows] int64, 0..max_k (0: no drafts this step)
    draft_probs: torch.Tensor | None,  # [num_rows, max_k, vocab_size] float32; None: n-gram drafts
    target_probs: torch.Tensor,  # [num_rows, max_k + 1, vocab_size] float32; last: bonus position
    is_greedy: torch.Tensor,  # [num_rows] bool
    generators: list[torch.Generator | None],  # [num_rows]; None: the default generator
) -> RejectionOutput:
    """Verify every row's drafts against the target in one pass (see the module docstring).

    Pure: the inputs are not modified. ``target_probs`` of greedy rows need not be one-hot: greedy
    rows only use its argmax.
    """
    _validate(draft_token_ids, num_draft_tokens, draft_probs, target_probs, is_greedy, generators)
    num_rows, max_k = draft_token_ids.shape
    device = target_probs.device
    # [num_rows, max_k]: True at the row's real drafts, False at padding.
    is_draft = torch.arange(max_k, device=device) < num_draft_tokens.unsqueeze(1)
    draft_token_ids = draft_token_ids.masked_fill(~is_draft, 0)  # padding -> a harmless index
    target_argmax = target_probs.argmax(dim=2)  # [num_rows, max_k + 1]
    greedy_rows = is_greedy.tolist()
    all_greedy = all(greedy_rows)
    # Greedy rows draw no random numbers, even when handed a generator.
    generators = [None if greedy else g for g, greedy in zip(generators, greedy_rows)]

    accepted = draft_token_ids == target_argmax[:, :max_k]  # [num_rows, max_k], the greedy rule
    if not all_greedy:
        sampled_accepted = _sampled_acceptance(
            draft_token_ids, num_draft_tokens, draft_probs, target_probs, generators
        )
        accepted = torch.where(is_greedy.unsqueeze(1), accepted, sampled_accepted)
    accepted &= is_draft
    # The running product is 1 up to the first rejection and 0 from there on, so its sum is the
    # number of leading acceptances, which is also the position of the recovered or bonus token.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_rows]

    last_token_ids = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [num_rows]
    if not all_greedy:
        last_probs = _recovered_or_bonus_probs(
            draft_token_ids, num_draft_tokens, draft_probs, target_probs, num_accepted
        )
        sampled_token_ids = random_sample(last_probs, generators)
        last_token_ids = torch.where(is_greedy, last_token_ids, sampled_token_ids)

    positions = torch.arange(max_k + 1, device=device)
    output_token_ids = torch.where(  # [num_rows, max_k + 1]
        positions < num_accepted.unsqueeze(1),
        torch.nn.functional.pad(draft_token_ids, (0, 1), value=PADDING_TOKEN_ID),
        PADDING_TOKEN_ID,
    )
    output_token_ids.scatter_(1, num_accepted.unsqueeze(1), last_token_ids.unsqueeze(1))
    return RejectionOutput(output_token_ids, num_accepted, num_accepted + 1)


def greedy_verify(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The greedy rule of ``rejection_sample`` for one row, on host lists: the drafts that
    equal the target argmax, then the argmax at the first mismatch (recovered) or after the
    last draft (bonus). ``target_token_ids`` holds the argmax at the k + 1 positions.

    For all-greedy steps the runner takes one argmax over the logits and calls this per
    row: no probabilities, no padded [rows, k + 1, vocab] tensors.
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"need one target token per draft plus the bonus position: "
            f"{len(target_token_ids)} != {len(draft_token_ids)} + 1"
        )
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return draft_token_ids[:num_accepted] + [target_token_ids[num_accepted]]


def _sampled_acceptance(
    draft_token_ids: torch.Tensor,  # [num_rows, max_k], padding already replaced by 0
    num_draft_tokens: torch.Tensor,  # [num_rows]
    draft_probs: torch.Tensor | None,  # [num_rows, max_k, vocab_size]
    target_probs: torch.Tensor,  # [num_rows, max_k + 1, vocab_size]
    generators: list[torch.Generator | None],  # [num_rows]
) -> torch.Tensor:  # [num_rows, max_k] bool; meaningless at padding positions
    """Accept draft x_j with probability min(1, target_probs[j, x_j] / draft_probs[j, x_j])."""
    max_k = draft_token_ids.shape[1]
    index = draft_token_ids.unsqueeze(2)  # [num_rows, max_k, 1]
    target_token_probs = target_probs[:, :max_k].gather(2, index).squeeze(2)  # [num_rows, max_k]
    uniforms = _uniforms(num_draft_tokens, max_k, generators, target_probs.device)
    if draft_probs is None:  # n-gram: the draft put probability 1 on its token
        return uniforms < target_token_probs
    draft_token_probs = draft_probs.gather(2, index).squeeze(2)  # [num_rows, max_k]
    # u < t / d without dividing; a token the target rules out (t = 0) is never accepted.
    return uniforms * draft_token_probs < target_token_probs


def _uniforms(
    num_draft_tokens: torch.Tensor,  # [num_rows]
    max_k: int,
    generators: list[torch.Generator | None],  # [num_rows]
    device: torch.device,
) -> torch.Tensor:  # [num_rows, max_k] float32 in [0, 1)
    """One call for the whole batch; then each seeded row redraws its own k from its generator."""
    uniforms = torch.rand(len(generators), max_k, device=device)
    seeded_rows = [i for i, g in enumerate(generators) if g is not None]
    if seeded_rows:
        num_draft_list = num_draft_tokens.tolist()
        for i in seeded_rows:
            k = num_draft_list[i]
            uniforms[i, :k] = torch.rand(k, generator=generators[i], device=device)
    return uniforms


def _recovered_or_bonus_probs(
    draft_token_ids: torch.Tensor,  # [num_rows, max_k], padding already replaced by 0
    num_draft_tokens: torch.Tensor,  # [num_rows]
    draft_probs: torch.Tensor | None,  # [num_rows, max_k, vocab_size]
    target_probs: torch.Tensor,  # [num_rows, max_k + 1, vocab_size]
    num_accepted: torch.Tensor,  # [num_rows]: the position of each row's last token
) -> torch.Tensor:  # [num_rows, vocab_size], unnormalised (the exponential race does not care)
    """Residual max(0, target - draft) at a rejected position; the target at the bonus one."""
    num_rows, max_k = draft_token_ids.shape
    rows = torch.arange(num_rows, device=target_probs.device)
    last_target_probs = target_probs[rows, num_accepted]  # [num_rows, vocab_size]
    if max_k == 0:
        return last_target_probs
    position = num_accepted.clamp(max=max_k - 1)  # the bonus rows' value is masked out below
    if draft_probs is None:
        last_draft_probs = torch.nn.functional.one_hot(
            draft_token_ids[rows, position], target_probs.shape[2]
        ).to(target_probs.dtype)
    else:
        last_draft_probs = draft_probs[rows, position]  # [num_rows, vocab_size]
    is_recovered = (num_accepted < num_draft_tokens).unsqueeze(1)  # [num_rows, 1]
    residual = (last_target_probs - last_draft_probs * is_recovered).clamp_min(0.0)
    # All zero only where draft == target there (so rejecting had probability 0): use the target.
    is_empty = residual.sum(dim=1, keepdim=True) == 0
    return torch.where(is_empty, last_target_probs, residual)


def _validate(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: list[torch.Generator | None],
) -> None:
    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids must be [num_rows, max_k] int64, got "
            f"{tuple(draft_token_ids.shape)} {draft_token_ids.dtype}"
        )
    num_rows, max_k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (num_rows, max_k + 1):
        raise ValueError(
            f"target_probs must be [num_rows={num_rows}, max_k + 1={max_k + 1}, vocab_size], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab_size = target_probs.shape[2]
    if target_probs.dtype != torch.float32 or vocab_size == 0:
        raise ValueError(
            f"target_probs must be float32 with vocab_size > 0, got {target_probs.dtype}"
        )
    if draft_probs is not None and (
        draft_probs.shape != (num_rows, max_k, vocab_size) or draft_probs.dtype != torch.float32
    ):
        raise ValueError(
            f"draft_probs must be [num_rows={num_rows}, max_k={max_k}, vocab_size={vocab_size}] "
            f"float32 or None, got {tuple(draft_probs.shape)} {draft_probs.dtype}"
        )
    for name, tensor, dtype in [
        ("num_draft_tokens", num_draft_tokens, torch.int64),
        ("is_greedy", is_greedy, torch.bool),
    ]:
        if tensor.shape != (num_rows,) or tensor.dtype != dtype:
            raise ValueError(
                f"{name} must be [num_rows={num_rows}] {dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
    if len(generators) != num_rows:
        raise ValueError(f"need one generator entry per row: {len(generators)} != {num_rows}")
    tensors = [draft_token_ids, num_draft_tokens, is_greedy]
    if draft_probs is not None:
        tensors.append(draft_probs)
    if any(t.device != target_probs.device for t in tensors):
        raise ValueError("all tensors must be on target_probs' device")
    # Values: one host sync for both checks.
    is_draft = torch.arange(max_k, device=target_probs.device) < num_draft_tokens.unsqueeze(1)
    bad_num = ((num_draft_tokens < 0) | (num_draft_tokens > max_k)).any()
    bad_ids = (is_draft & ((draft_token_ids < 0) | (draft_token_ids >= vocab_size))).any()
    bad_num, bad_ids = torch.stack([bad_num, bad_ids]).tolist()
    if bad_num:
        raise ValueError(f"num_draft_tokens must lie in [0, max_k={max_k}]")
    if bad_ids:
        raise ValueError(f"draft token ids must lie in [0, vocab_size={vocab_size})")
