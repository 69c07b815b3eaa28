"""Grammar masks on a step's logits: only the constrained rows are touched.

Each constrained row's matcher writes its allowed-token bitmask (llguidance's layout: token t
is allowed when bit ``t % 32`` of int32 word ``t // 32`` is set) into one CPU tensor; the bits
are unpacked and the forbidden logits of those rows set to -inf. A step without constrained
rows costs one scan of the row list. Speculative verification masks each verified position
with the matcher advanced over the drafts before it, and cuts the drafts at the first one the
grammar forbids (a forbidden draft is rejected); the matcher is rolled back afterwards, and
advances later over the tokens the verifier actually emits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from engine.grammar import GrammarState, GrammarStats

def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 on the CPU -> [rows, vocab_size] bool, True where the token is NOT
    allowed. numpy's ``unpackbits`` does it in one C loop (measured on a loaded 2-CPU machine:
    ~8 µs per 49152-token row against ~25 µs and more for torch shifts)."""
    inverted = np.invert(bitmask.numpy()).view(np.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    bits = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def _apply(logits: torch.Tensor, row_ids: list[int], bitmask: torch.Tensor) -> None:
    """Set the forbidden logits of ``row_ids`` (rows of ``bitmask`` in that order) to -inf."""
    forbidden = forbidden_tokens(bitmask, logits.shape[1]).to(logits.device)
    first = row_ids[0]
    if row_ids == list(range(first, first + len(row_ids))):  # a block of rows: in place
        logits[first:first + len(row_ids)].masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def mask_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    states: Sequence[GrammarState | None],  # [num_rows]; None: unconstrained row
    stats: GrammarStats | None = None,
) -> None:
    """Mask each constrained row by its matcher's next-token set."""
    row_ids = [i for i, state in enumerate(states) if state is not None]
    if not row_ids:
        return
    start = time.perf_counter()
    words = _words(logits.shape[1])
    bitmask = torch.empty(len(row_ids), words, dtype=torch.int32)
    for slot, row in enumerate(row_ids):
        states[row].fill_mask(bitmask[slot].data_ptr(), words * 4)  # type: ignore[union-attr]
    _apply(logits, row_ids, bitmask)
    if stats is not None:
        stats.num_mask_rows += len(row_ids)
        stats.mask_seconds += time.perf_counter() - start


def _draft_bitmask(state: GrammarState, drafts: list[int], words: int) -> tuple[int, torch.Tensor]:
    """The number of drafts the grammar allows (j), and the masks of positions 0..j."""
    num_valid = state.num_valid(drafts)
    bitmask = torch.empty(num_valid + 1, words, dtype=torch.int32)
    state.fill_mask(bitmask[0].data_ptr(), words * 4)
    for position, token_id in enumerate(drafts[:num_valid], start=1):
        if not state.accept([token_id]):
            raise RuntimeError(f"grammar refused draft {token_id} it had validated: {state.error}")
        state.fill_mask(bitmask[position].data_ptr(), words * 4)
    state.rollback(num_valid)
    return num_valid, bitmask


def mask_verification(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab_size]: each request's k + 1 rows, in order
    drafts: list[list[int]],  # each request's drafts (k_i)
    states: Sequence[GrammarState | None],
    stats: GrammarStats | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Masked logits and drafts cut at the first token each grammar forbids. When a cut
    happens the logits are compacted to the kept rows (k'_i + 1 per request)."""
    if all(state is None for state in states):
        return logits, drafts
    start_time = time.perf_counter()
    words = _words(logits.shape[1])
    kept_rows: list[int] = []
    masked_rows: list[int] = []
    masks: list[torch.Tensor] = []
    new_drafts: list[list[int]] = []
    start = 0
    for row_drafts, state in zip(drafts, states):
        num_valid = len(row_drafts)
        if state is not None:
            num_valid, bitmask = _draft_bitmask(state, row_drafts, words)
            masked_rows.extend(range(start, start + num_valid + 1))
            masks.append(bitmask)
        kept_rows.extend(range(start, start + num_valid + 1))
        new_drafts.append(row_drafts[:num_valid])
        start += len(row_drafts) + 1
    _apply(logits, masked_rows, torch.cat(masks))
    if stats is not None:
        stats.num_mask_rows += len(masked_rows)
        stats.mask_seconds += time.perf_counter() - start_time
    if len(kept_rows) < logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(kept_rows, dtype=torch.int64, device=logits.device))
    return logits, new_drafts
