"""Rejection sampler tests: greedy rows reproduce greedy decoding exactly, sampled rows preserve the
target distribution (chi-square, small model and n-gram drafts), seeded rows do not depend on the
batch, the output layout holds for any batch (hypothesis), and the spec-decode counters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from engine.sampler import random_sample
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.rejection_sampler import (
    PADDING_TOKEN_ID,
    RejectionOutput,
    greedy_verify,
    rejection_sample,
)

VOCAB_SIZE = 50


def _probs(*shape: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Random distributions over the last dimension (spread, so argmaxes are clear)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).softmax(dim=-1)


def _greedy(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> RejectionOutput:
    num_rows = draft_token_ids.shape[0]
    return rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        torch.ones(num_rows, dtype=torch.bool),
        [None] * num_rows,
    )


def _greedy_reference(
    draft_token_ids: list[int], target_argmax: list[int]
) -> list[int]:
    """Plain greedy decoding, one position at a time: drafts kept while they are the argmax."""
    output = []
    for position, token_id in enumerate(draft_token_ids):
        output.append(target_argmax[position])
        if token_id != target_argmax[position]:
            return output
    return output + [target_argmax[len(draft_token_ids)]]


def _check_layout(
    out: RejectionOutput, draft_token_ids: torch.Tensor, num_draft: torch.Tensor
) -> None:
    """Accepted drafts, then one real token, then padding; counts consistent."""
    assert torch.equal(out.num_output, out.num_accepted + 1)
    assert bool((out.num_accepted >= 0).all()) and bool((out.num_accepted <= num_draft).all())
    for i, n in enumerate(out.num_accepted.tolist()):
        assert out.output_token_ids[i, :n].tolist() == draft_token_ids[i, :n].tolist()
        assert 0 <= int(out.output_token_ids[i, n]) < VOCAB_SIZE
        assert bool((out.output_token_ids[i, n + 1 :] == PADDING_TOKEN_ID).all())


# --------------------------------------------------------------------------- greedy


def test_greedy_accepts_drafts_that_are_the_argmax_and_adds_the_bonus() -> None:
    num_rows, max_k = 6, 4
    target_probs = _probs(num_rows, max_k + 1, VOCAB_SIZE, seed=0)
    target_argmax = target_probs.argmax(dim=2)
    num_draft = torch.full((num_rows,), max_k)
    out = _greedy(target_argmax[:, :max_k].clone(), num_draft, target_probs)
    assert out.num_accepted.tolist() == [max_k] * num_rows
    assert torch.equal(out.output_token_ids, target_argmax)  # drafts + bonus argmax


def test_greedy_mismatch_at_j_accepts_j_and_recovers_the_argmax() -> None:
    max_k = 4
    target_probs = _probs(max_k, max_k + 1, VOCAB_SIZE, seed=1)
    target_argmax = target_probs.argmax(dim=2)
    draft_token_ids = target_argmax[:, :max_k].clone()
    for j in range(max_k):  # row j: its draft at position j is wrong
        draft_token_ids[j, j] = (target_argmax[j, j] + 1) % VOCAB_SIZE
    out = _greedy(draft_token_ids, torch.full((max_k,), max_k), target_probs)
    assert out.num_accepted.tolist() == list(range(max_k))
    for j in range(max_k):
        assert out.output_token_ids[j, : j + 1].tolist() == target_argmax[j, : j + 1].tolist()
        assert out.output_token_ids[j, j + 1 :].tolist() == [PADDING_TOKEN_ID] * (max_k - j)


def test_greedy_rows_without_drafts_output_the_bonus_of_position_0() -> None:
    target_probs = _probs(3, 4, VOCAB_SIZE, seed=2)
    draft_token_ids = torch.full((3, 3), 7)  # padding; its value must not matter
    out = _greedy(draft_token_ids, torch.zeros(3, dtype=torch.int64), target_probs)
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert out.output_token_ids[:, 0].tolist() == target_probs[:, 0].argmax(dim=1).tolist()
    assert bool((out.output_token_ids[:, 1:] == PADDING_TOKEN_ID).all())
    # max_k = 0: nobody speculates at all.
    empty = torch.empty(3, 0, dtype=torch.int64)
    out = _greedy(empty, torch.zeros(3, dtype=torch.int64), target_probs[:, :1])
    assert out.output_token_ids[:, 0].tolist() == target_probs[:, 0].argmax(dim=1).tolist()


def test_greedy_mixed_k_matches_greedy_decoding() -> None:
    num_rows, max_k, vocab_size = 64, 5, 4  # small vocab: random drafts often match
    target_probs = _probs(num_rows, max_k + 1, vocab_size, seed=3)
    target_argmax = target_probs.argmax(dim=2)
    generator = torch.Generator().manual_seed(3)
    draft_token_ids = torch.randint(0, vocab_size, (num_rows, max_k), generator=generator)
    num_draft = torch.randint(0, max_k + 1, (num_rows,), generator=generator)
    # Drafts from a (wrong) small model's distribution: greedy rows must ignore it.
    draft_probs = _probs(num_rows, max_k, vocab_size, seed=4)
    out = _greedy(draft_token_ids, num_draft, target_probs, draft_probs)
    for i in range(num_rows):
        k = int(num_draft[i])
        expected = _greedy_reference(draft_token_ids[i, :k].tolist(), target_argmax[i].tolist())
        assert out.output_token_ids[i, : len(expected)].tolist() == expected
        assert int(out.num_output[i]) == len(expected)
    assert len(set(out.num_accepted.tolist())) > 2  # the batch really mixes outcomes


def test_greedy_draws_no_random_numbers() -> None:
    target_probs = _probs(4, 3, VOCAB_SIZE, seed=5)
    generators = [torch.Generator().manual_seed(9) for _ in range(4)]
    before = [g.get_state() for g in generators]
    default_before = torch.get_rng_state()
    rejection_sample(
        target_probs[:, :2].argmax(dim=2),
        torch.full((4,), 2),
        None,
        target_probs,
        torch.ones(4, dtype=torch.bool),
        generators,
    )
    assert torch.equal(torch.get_rng_state(), default_before)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, before))


# --------------------------------------------------------------------------- sampling


def _sampled(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    seed: int = 0,
) -> RejectionOutput:
    num_rows = draft_token_ids.shape[0]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return rejection_sample(
            draft_token_ids,
            num_draft_tokens,
            draft_probs,
            target_probs,
            torch.zeros(num_rows, dtype=torch.bool),
            [None] * num_rows,
        )


def _draw(probs: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per distribution ([..., vocab_size] -> [...]), seeded."""
    generator = torch.Generator().manual_seed(seed)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def test_draft_equal_to_target_accepts_everything() -> None:
    num_rows, max_k = 256, 4
    target_probs = _probs(num_rows, max_k + 1, VOCAB_SIZE, seed=6, scale=1.0)
    draft_probs = target_probs[:, :max_k].clone()
    draft_token_ids = _draw(draft_probs, seed=6)
    generator = torch.Generator().manual_seed(6)
    num_draft = torch.randint(0, max_k + 1, (num_rows,), generator=generator)
    out = _sampled(draft_token_ids, num_draft, draft_probs, target_probs)
    assert torch.equal(out.num_accepted, num_draft)
    _check_layout(out, draft_token_ids, num_draft)


NUM_TRIALS = 20_000
SMALL_VOCAB = 12


def _chi_square_pvalue(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the counts of ``token_ids`` against ``probs``; tokens outside its support fail."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() / probs[support].double().sum() * token_ids.numel()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def _target_and_draft(filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed target over SMALL_VOCAB and a clearly different draft ([SMALL_VOCAB] each).
    ``filtered``: the target rules out tokens (as top-k would) that the draft still proposes."""
    target = _probs(SMALL_VOCAB, seed=10, scale=1.0)
    if filtered:
        target[:3] = 0.0
        target /= target.sum()
    draft = _probs(SMALL_VOCAB, seed=11, scale=1.0)
    return target, draft


@pytest.mark.parametrize("filtered", [False, True], ids=["full_support", "target_filtered"])
def test_first_token_is_distributed_as_the_target(filtered: bool) -> None:
    target, draft = _target_and_draft(filtered)
    draft_token_ids = _draw(draft.expand(NUM_TRIALS, 1, -1), seed=12)  # [NUM_TRIALS, 1]
    assert _chi_square_pvalue(draft_token_ids[:, 0], target) < 1e-6  # the draft alone is wrong
    out = _sampled(
        draft_token_ids,
        torch.ones(NUM_TRIALS, dtype=torch.int64),
        draft.expand(NUM_TRIALS, 1, -1),
        torch.stack([target, _probs(SMALL_VOCAB, seed=13)]).expand(NUM_TRIALS, -1, -1),
    )
    assert _chi_square_pvalue(out.output_token_ids[:, 0], target) > 0.001
    # Acceptance rate is sum_x min(target(x), draft(x)); 6 binomial standard deviations.
    expected_rate = float(torch.minimum(target, draft).sum())
    tolerance = 6 * (expected_rate * (1 - expected_rate) / NUM_TRIALS) ** 0.5
    assert abs(out.num_accepted.double().mean().item() - expected_rate) < tolerance


def test_first_token_is_distributed_as_the_target_with_ngram_drafts() -> None:
    target, _ = _target_and_draft(filtered=False)
    proposed = 5
    draft_token_ids = torch.full((NUM_TRIALS, 1), proposed)
    assert _chi_square_pvalue(draft_token_ids[:, 0], target) < 1e-6
    out = _sampled(
        draft_token_ids,
        torch.ones(NUM_TRIALS, dtype=torch.int64),
        None,
        torch.stack([target, _probs(SMALL_VOCAB, seed=13)]).expand(NUM_TRIALS, -1, -1),
    )
    assert _chi_square_pvalue(out.output_token_ids[:, 0], target) > 0.001
    expected_rate = float(target[proposed])  # accepted with the target's probability of it
    tolerance = 6 * (expected_rate * (1 - expected_rate) / NUM_TRIALS) ** 0.5
    assert abs(out.num_accepted.double().mean().item() - expected_rate) < tolerance


def test_later_tokens_given_accepted_drafts_are_distributed_as_the_target() -> None:
    target_probs = _probs(3, SMALL_VOCAB, seed=20, scale=1.0)  # positions 0, 1 and the bonus
    draft_probs = _probs(2, SMALL_VOCAB, seed=21, scale=1.0)
    draft_token_ids = _draw(draft_probs.expand(NUM_TRIALS, -1, -1), seed=23)  # [NUM_TRIALS, 2]
    out = _sampled(
        draft_token_ids,
        torch.full((NUM_TRIALS,), 2),
        draft_probs.expand(NUM_TRIALS, -1, -1),
        target_probs.expand(NUM_TRIALS, -1, -1),
    )
    assert _chi_square_pvalue(out.output_token_ids[:, 0], target_probs[0]) > 0.001
    first_accepted = out.num_accepted >= 1
    assert int(first_accepted.sum()) > NUM_TRIALS // 3
    second = out.output_token_ids[first_accepted, 1]
    assert _chi_square_pvalue(second, target_probs[1]) > 0.001
    assert _chi_square_pvalue(draft_token_ids[first_accepted, 1], target_probs[1]) < 1e-6
    bonus = out.output_token_ids[out.num_accepted == 2, 2]
    assert _chi_square_pvalue(bonus, target_probs[2]) > 0.001


def test_rows_without_drafts_draw_what_the_sampler_draws() -> None:
    target_probs = _probs(4, 1, VOCAB_SIZE, seed=30, scale=1.0)
    generators = [torch.Generator().manual_seed(s) for s in range(4)]
    out = rejection_sample(
        torch.empty(4, 0, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
        None,
        target_probs,
        torch.zeros(4, dtype=torch.bool),
        generators,
    )
    fresh = [torch.Generator().manual_seed(s) for s in range(4)]
    assert torch.equal(out.output_token_ids[:, 0], random_sample(target_probs[:, 0], fresh))


# --------------------------------------------------------------------------- seeded rows


SEEDED_ROW_K = 3


def _seeded_row_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seeded row's target_probs [k + 1, vocab], draft_probs [k, vocab], draft ids [k]."""
    target_probs = _probs(SEEDED_ROW_K + 1, VOCAB_SIZE, seed=40, scale=1.0)
    draft_probs = _probs(SEEDED_ROW_K, VOCAB_SIZE, seed=41, scale=1.0)
    return target_probs, draft_probs, _draw(draft_probs, seed=42)


def _run_seeded(seed: int, position: int, batch_size: int) -> list[int]:
    """The seeded row's output, at ``position`` of a batch of other rows (max_k grows with it)."""
    row_k = SEEDED_ROW_K
    target_row, draft_row, draft_ids_row = _seeded_row_inputs()
    max_k = row_k if batch_size == 1 else 5
    target_probs = _probs(batch_size, max_k + 1, VOCAB_SIZE, seed=100 + batch_size, scale=1.0)
    draft_probs = _probs(batch_size, max_k, VOCAB_SIZE, seed=200 + batch_size, scale=1.0)
    draft_token_ids = _draw(draft_probs, seed=300 + batch_size)
    num_draft = torch.arange(batch_size) % (max_k + 1)
    is_greedy = torch.arange(batch_size) % 3 == 0
    generators: list[torch.Generator | None] = [
        torch.Generator().manual_seed(1000 + i) if i % 2 else None for i in range(batch_size)
    ]
    target_probs[position, : row_k + 1] = target_row
    draft_probs[position, :row_k] = draft_row
    draft_token_ids[position, :row_k] = draft_ids_row
    num_draft[position] = row_k
    is_greedy[position] = False
    generators[position] = torch.Generator().manual_seed(seed)
    out = rejection_sample(
        draft_token_ids, num_draft, draft_probs, target_probs, is_greedy, generators
    )
    return out.output_token_ids[position, : int(out.num_output[position])].tolist()


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    outputs = set()
    for seed in range(12):
        alone = _run_seeded(seed, position=0, batch_size=1)
        assert _run_seeded(seed, position=5, batch_size=9) == alone
        assert _run_seeded(seed, position=2, batch_size=4) == alone
        outputs.add(tuple(alone))
    assert len(outputs) > 3  # really sampling: seeds give different outcomes


# --------------------------------------------------------------------------- any batch (property)


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    max_k=st.integers(0, 4),
    ngram=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_output_layout_for_any_batch(num_rows: int, max_k: int, ngram: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    target_probs = _probs(num_rows, max_k + 1, VOCAB_SIZE, seed=seed, scale=2.0)
    target_probs[target_probs < 0.01] = 0.0  # filtered tokens, as top-k / top-p leave them
    draft_probs = None if ngram else _probs(num_rows, max_k, VOCAB_SIZE, seed=seed + 1)
    draft_token_ids = torch.randint(0, VOCAB_SIZE, (num_rows, max_k), generator=generator)
    num_draft = torch.randint(0, max_k + 1, (num_rows,), generator=generator)
    draft_token_ids[torch.arange(max_k) >= num_draft.unsqueeze(1)] = -7  # padding, any value
    is_greedy = torch.rand(num_rows, generator=generator) < 0.3
    generators = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(num_rows)]
    inputs = [t.clone() for t in (draft_token_ids, num_draft, target_probs, is_greedy)]
    out = rejection_sample(
        draft_token_ids, num_draft, draft_probs, target_probs, is_greedy, generators
    )
    _check_layout(out, draft_token_ids, num_draft)
    for before, after in zip(inputs, (draft_token_ids, num_draft, target_probs, is_greedy)):
        assert torch.equal(before, after)  # pure
    # Nothing the target rules out is ever emitted.
    emitted = out.output_token_ids.clamp_min(0).unsqueeze(2)  # [num_rows, max_k + 1, 1]
    emitted_probs = target_probs.gather(2, emitted).squeeze(2)
    is_output = torch.arange(max_k + 1) < out.num_output.unsqueeze(1)
    assert bool((emitted_probs[is_output] > 0).all())


@settings(max_examples=50, deadline=None)
@given(num_rows=st.integers(1, 6), max_k=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_greedy_verify_is_the_greedy_rule_of_rejection_sample(num_rows: int, max_k: int, seed: int) -> None:
    """The host-side fast path emits exactly what rejection_sample emits for greedy rows."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = _probs(num_rows, max_k + 1, VOCAB_SIZE, seed=seed)
    target_argmax = target_probs.argmax(dim=2)
    # Drafts that mostly agree with the target, so every acceptance length occurs.
    draft_token_ids = target_argmax[:, :max_k].clone()
    flip = torch.rand(num_rows, max_k, generator=generator) < 0.3
    draft_token_ids[flip] = torch.randint(0, VOCAB_SIZE, (int(flip.sum()),), generator=generator)
    num_draft = torch.randint(0, max_k + 1, (num_rows,), generator=generator)
    out = _greedy(draft_token_ids, num_draft, target_probs)
    for i in range(num_rows):
        k = int(num_draft[i])
        fast = greedy_verify(draft_token_ids[i, :k].tolist(), target_argmax[i, : k + 1].tolist())
        assert fast == out.output_token_ids[i, : int(out.num_output[i])].tolist()


def test_greedy_verify_by_hand_and_bad_lengths() -> None:
    assert greedy_verify([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert greedy_verify([4, 9, 6], [4, 5, 6, 7]) == [4, 5]  # recovered at position 1
    assert greedy_verify([], [3]) == [3]  # no drafts: the bonus of position 0
    with pytest.raises(ValueError, match="one target token per draft"):
        greedy_verify([1, 2], [1, 2])


# --------------------------------------------------------------------------- validation


def test_rejects_bad_input() -> None:
    num_rows, max_k = 2, 3
    good = dict(
        draft_token_ids=torch.zeros(num_rows, max_k, dtype=torch.int64),
        num_draft_tokens=torch.full((num_rows,), max_k),
        draft_probs=_probs(num_rows, max_k, VOCAB_SIZE, seed=0),
        target_probs=_probs(num_rows, max_k + 1, VOCAB_SIZE, seed=1),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool),
        generators=[None] * num_rows,
    )
    rejection_sample(**good)  # type: ignore[arg-type]
    bad_cases = [
        ("draft_token_ids", torch.zeros(num_rows, max_k, dtype=torch.int32), "draft_token_ids"),
        ("draft_token_ids", torch.zeros(num_rows * max_k, dtype=torch.int64), "draft_token_ids"),
        ("target_probs", _probs(num_rows, max_k, VOCAB_SIZE, seed=1), "target_probs"),
        ("target_probs", _probs(num_rows, max_k + 1, VOCAB_SIZE, seed=1).double(), "target_probs"),
        ("draft_probs", _probs(num_rows, max_k, VOCAB_SIZE + 1, seed=0), "draft_probs"),
        ("draft_probs", _probs(num_rows, max_k, VOCAB_SIZE, seed=0).half(), "draft_probs"),
        ("num_draft_tokens", torch.full((num_rows,), max_k, dtype=torch.int32), "num_draft_tokens"),
        ("num_draft_tokens", torch.full((num_rows,), max_k + 1), r"\[0, max_k=3\]"),
        ("num_draft_tokens", torch.full((num_rows,), -1), r"\[0, max_k=3\]"),
        ("is_greedy", torch.zeros(num_rows + 1, dtype=torch.bool), "is_greedy"),
        ("is_greedy", torch.zeros(num_rows, dtype=torch.int64), "is_greedy"),
        ("generators", [None], "one generator entry per row"),
        ("draft_token_ids", torch.full((num_rows, max_k), VOCAB_SIZE), "vocab_size"),
        ("draft_token_ids", torch.full((num_rows, max_k), -1), "vocab_size"),
    ]
    for name, value, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            rejection_sample(**{**good, name: value})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- metrics


def test_stats_count_a_hand_made_example() -> None:
    stats_ = SpecDecodeStats()
    assert (stats_.mean_acceptance_length, stats_.acceptance_rate) == (1.0, 0.0)
    stats_.observe(torch.tensor([3, 0, 2, 3]), torch.tensor([3, 0, 1, 0]))
    assert (stats_.num_drafts, stats_.num_draft_tokens, stats_.num_accepted_tokens) == (3, 8, 4)
    assert stats_.accepted_per_position == [2, 1, 1]
    stats_.observe(torch.tensor([1, 4]), torch.tensor([1, 2]))
    assert (stats_.num_drafts, stats_.num_draft_tokens, stats_.num_accepted_tokens) == (5, 13, 7)
    assert stats_.accepted_per_position == [4, 2, 1]
    assert stats_.mean_acceptance_length == pytest.approx(1 + 7 / 5)
    assert stats_.acceptance_rate == pytest.approx(7 / 13)
    stats_.observe(torch.tensor([0, 0]), torch.tensor([0, 0]))  # nobody speculated: no change
    assert (stats_.num_drafts, stats_.accepted_per_position) == (5, [4, 2, 1])


def test_stats_take_lists_as_tensors() -> None:
    from_lists, from_tensors = SpecDecodeStats(), SpecDecodeStats()
    from_lists.observe([3, 0, 2, 3], [3, 0, 1, 0])
    from_tensors.observe(torch.tensor([3, 0, 2, 3]), torch.tensor([3, 0, 1, 0]))
    assert from_lists == from_tensors


def test_stats_reject_inconsistent_counts() -> None:
    with pytest.raises(ValueError, match="num_accepted must lie"):
        SpecDecodeStats().observe(torch.tensor([2]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"\[num_rows\]"):
        SpecDecodeStats().observe(torch.tensor([2, 1]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"\[num_rows\]"):
        SpecDecodeStats().observe(torch.tensor([[2]]), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="num_accepted must lie"):
        SpecDecodeStats().observe([1, 2], [0, -1])
