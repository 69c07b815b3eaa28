"""N-gram prompt lookup: exact proposals on hand-made sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram


def test_longest_suffix_most_recent_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurs at 1 and 5; the most recent (5) is followed by 7, 8, 5.
    assert propose_ngram(tokens, 3, 1, 4) == [7, 8, 5]
    # A longer suffix wins over a more recent shorter one.
    tokens = [4, 5, 6, 1, 9, 6, 2, 4, 5, 6]
    assert propose_ngram(tokens, 2, 1, 3) == [1, 9]


def test_no_match_and_bounds() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []
    assert propose_ngram([5], 3, 1, 4) == []
    assert propose_ngram([1, 2, 1], 5, 1, 4) == [2, 1]  # fewer than k tokens follow
    assert propose_ngram([1, 2, 3, 1, 2], 2, 3, 4) == []  # min_n=3: [1, 2] is too short


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(method="medusa"), "method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="draft_model"), "draft_model"),
        (dict(ngram_min=3, ngram_max=2), "ngram_min"),
    ],
)
def test_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)


def _reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: longest recurring suffix first, then its last earlier match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
)
def test_matches_the_definition(tokens: list[int], k: int, min_n: int, extra_n: int) -> None:
    max_n = min_n + extra_n
    assert propose_ngram(tokens, k, min_n, max_n) == _reference_ngram(tokens, k, min_n, max_n)


def test_repeat_copies_on_over_its_own_proposal() -> None:
    # [7, 8, 9] recurs one period (3 tokens) back: the loop is predicted to go on.
    tokens = [1, 7, 8, 9, 7, 8, 9, 7]
    assert propose_ngram(tokens, 5, 1, 4) == [8, 9, 7]  # the plain copy stops at the end
    assert propose_ngram(tokens, 5, 1, 4, repeat=True) == [8, 9, 7, 8, 9]
    assert propose_ngram([5, 5], 4, 1, 4, repeat=True) == [5, 5, 5, 5]  # period 1
    # A match far enough back has k tokens to copy: repeat changes nothing.
    tokens = [3, 4, 5, 6, 2, 3, 4]
    assert propose_ngram(tokens, 2, 1, 4, repeat=True) == propose_ngram(tokens, 2, 1, 4) == [5, 6]
    assert propose_ngram([1, 2, 3], 4, 1, 4, repeat=True) == []  # no match, nothing to repeat


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 8), min_n=st.integers(1, 3))
def test_repeat_is_the_plain_copy_over_the_extended_sequence(tokens: list[int], k: int, min_n: int) -> None:
    """Each repeated draft is the token the copy reads once the earlier drafts are appended."""
    plain = propose_ngram(tokens, k, min_n, 4)
    drafts = propose_ngram(tokens, k, min_n, 4, repeat=True)
    assert drafts[: len(plain)] == plain and len(drafts) == (k if plain else 0)
    if drafts:
        start = _match_end(tokens, min_n) + 1
        extended = tokens + drafts
        assert drafts == [extended[start + j] for j in range(k)]


def _match_end(tokens: list[int], min_n: int) -> int:
    """Where the chosen match ends: the position just before the first (plain) draft."""
    for n in range(min(4, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return starts[-1] + n - 1
    raise AssertionError("no match")
