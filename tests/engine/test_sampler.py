"""Sampler tests: exact agreement with Hugging Face's processors, seeded reproducibility across
batches, support of the filters (hypothesis), logprobs, and a chi-square check of the draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
    compute_probs,
    make_generator,
    process_logits,
)
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB_SIZE = 300


def _logits(num_rows: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3.0


def _histories(num_rows: int, vocab_size: int = VOCAB_SIZE, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab_size, (5 + 7 * i % 40,), generator=generator).tolist()
        for i in range(num_rows)
    ]


def _metadata(
    params: list[SamplingParams], token_ids: list[list[int]] | None = None
) -> SamplingMetadata:
    if token_ids is None:
        token_ids = [[] for _ in params]
    generators = [make_generator(p, CPU) for p in params]
    return SamplingMetadata.build(params, token_ids, generators, CPU)


def _hf_row(
    logits_row: torch.Tensor, history: list[int], p: SamplingParams
) -> torch.Tensor:
    """Row i through HF's processors in ``generate``'s order ([1, vocab_size])."""
    scores = logits_row.unsqueeze(0).clone()
    input_ids = torch.tensor([history], dtype=torch.int64)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    if p.greedy:
        return scores
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.top_k_enabled:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    metadata = _metadata([SamplingParams(temperature=0.0)] * 8)
    assert metadata.all_greedy and not metadata.needs_penalties and not metadata.needs_logprobs
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_inside_a_sampled_batch_are_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=3) for i in range(6)]
    out = Sampler()(logits, _metadata(params))
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(dim=1))


def test_greedy_with_repetition_penalty_matches_hf() -> None:
    num_rows = 8
    logits = _logits(num_rows)
    histories = _histories(num_rows)
    # Make the penalty decide: put each row's maximum on a token it has already seen.
    for i, history in enumerate(histories):
        logits[i, history[0]] = logits[i].max() + 0.5
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05, 3.0, 1.2, 1.5]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in penalties]
    out = Sampler()(logits, _metadata(params, histories))
    expected = torch.stack(
        [_hf_row(logits[i], histories[i], params[i])[0].argmax() for i in range(num_rows)]
    )
    assert torch.equal(out.sampled_token_ids, expected)
    assert not torch.equal(expected, logits.argmax(dim=1))  # the penalty changed something


def test_repetition_penalty_equals_hf_processor() -> None:
    logits = _logits(4)
    logits[0, :10] = -logits[0, :10].abs()  # negative seen logits take the multiply branch
    input_ids = torch.randint(0, VOCAB_SIZE, (4, 30), generator=torch.Generator().manual_seed(3))
    input_ids[0, :10] = torch.arange(10)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(input_ids, logits.clone())
    actual = apply_repetition_penalty(
        logits,
        torch.full((4,), 1.3),
        torch.arange(4).repeat_interleave(30),
        input_ids.flatten(),
    )
    assert torch.equal(actual, expected)


def test_repetition_penalty_ignores_out_of_vocab_ids() -> None:
    logits = _logits(1, vocab_size=8)
    actual = apply_repetition_penalty(
        logits, torch.tensor([2.0]), torch.tensor([0, 0]), torch.tensor([3, 50])
    )
    expected = logits.clone()
    expected[0, 3] = expected[0, 3] * 2.0 if expected[0, 3] < 0 else expected[0, 3] / 2.0
    assert torch.equal(actual, expected)


# --------------------------------------------------------------------------- HF warpers


@pytest.mark.parametrize("top_k", [1, 5, 50, VOCAB_SIZE, VOCAB_SIZE + 10])
def test_top_k_matches_hf(top_k: int) -> None:
    logits = _logits(6)
    logits[0] = torch.round(logits[0])  # many ties at the k-th value
    actual = apply_top_k_top_p(logits, torch.full((6,), top_k), None)
    assert torch.equal(actual, TopKLogitsWarper(top_k)(None, logits))


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_top_p_matches_hf(top_p: float) -> None:
    logits = _logits(6)
    actual = apply_top_k_top_p(logits, None, torch.full((6,), top_p))
    assert torch.equal(actual, TopPLogitsWarper(top_p)(None, logits))


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p: float) -> None:
    logits = _logits(6)
    actual = apply_min_p(logits, torch.full((6,), min_p))
    assert torch.equal(actual, MinPLogitsWarper(min_p)(None, logits))


def test_full_chain_with_per_row_params_matches_hf() -> None:
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=2.0, min_p=0.2, repetition_penalty=0.8),
        SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.5),
        SamplingParams(temperature=1.1, top_k=50, top_p=0.3),
        SamplingParams(temperature=0.9, top_p=0.95, min_p=0.1),
    ]
    logits = _logits(len(params))
    histories = _histories(len(params))
    actual = process_logits(logits, _metadata(params, histories))
    expected = torch.cat([_hf_row(logits[i], histories[i], p) for i, p in enumerate(params)])
    assert torch.equal(actual, expected)


def test_compute_probs_is_softmax_of_processed_logits_and_one_hot_for_greedy() -> None:
    params = [SamplingParams(temperature=0.8, top_k=10), SamplingParams(temperature=0.0)]
    logits = _logits(2)
    metadata = _metadata(params)
    probs = compute_probs(logits, metadata)
    assert torch.equal(probs[0], process_logits(logits, metadata)[0].softmax(dim=0))
    assert torch.count_nonzero(probs[0]) == 10
    one_hot = torch.nn.functional.one_hot(logits[1].argmax(), VOCAB_SIZE).float()
    assert torch.equal(probs[1], one_hot)


def test_sampler_does_not_modify_logits() -> None:
    logits = _logits(3)
    before = logits.clone()
    params = [SamplingParams(top_k=4, top_p=0.8, min_p=0.1, repetition_penalty=1.4, logprobs=2)] * 3
    Sampler()(logits, _metadata(params, _histories(3)))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- seeded draws

TARGET = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, repetition_penalty=1.2, seed=1234)
NUM_STEPS = 5


def _target_logits(step: int) -> torch.Tensor:
    return _logits(1, seed=1000 + step)[0]


def _other_params(i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=1.0, seed=i)  # seeded
    if kind == 1:
        return SamplingParams(temperature=1.2, top_p=0.9)  # unseeded
    if kind == 2:
        return SamplingParams(temperature=0.0, repetition_penalty=1.1)  # greedy
    return SamplingParams(temperature=0.7, min_p=0.05, seed=7, logprobs=2)  # same seed as others


def _run_target(
    position: int, batch_size: int, noise_seed: int, device: torch.device = CPU
) -> list[int]:
    """Decode NUM_STEPS tokens with TARGET at ``position``; other rows get ``noise_seed`` logits."""
    params = [TARGET if i == position else _other_params(i) for i in range(batch_size)]
    generators = [make_generator(p, device) for p in params]
    histories = [[1, 2, 3] for _ in range(batch_size)]
    for step in range(NUM_STEPS):
        logits = _logits(batch_size, seed=noise_seed + step)
        logits[position] = _target_logits(step)
        logits = logits.to(device)
        metadata = SamplingMetadata.build(params, histories, generators, device)
        sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
        for history, token_id in zip(histories, sampled):
            history.append(token_id)
    return histories[position][3:]


DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_row_is_independent_of_batch_and_position(device: torch.device) -> None:
    alone = _run_target(position=0, batch_size=1, noise_seed=0, device=device)
    for position, noise_seed in [(0, 10), (13, 20), (31, 30)]:
        assert _run_target(position, batch_size=32, noise_seed=noise_seed, device=device) == alone
    assert len(set(alone)) > 1  # really sampling, not a constant


def test_different_seeds_give_different_tokens() -> None:
    logits = (_logits(1) / 3.0).expand(64, -1)
    params = [SamplingParams(seed=s) for s in range(64)]
    sampled = Sampler()(logits, _metadata(params)).sampled_token_ids
    assert len(set(sampled.tolist())) > 10


# --------------------------------------------------------------------------- support (property)


def _expected_support(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, required) token masks, computed in float64 with a tolerance either way: the
    sampler may keep only allowed tokens and must keep every required one."""
    tol = 1e-4
    scaled32 = logits / temperature  # the input of the warpers, as the sampler computes it
    scaled = scaled32.double().numpy()
    # top-k keeps every token with fewer than k strictly larger logits (ties at k-th all stay).
    num_larger = (scaled[None, :] > scaled[:, None]).sum(axis=1)
    in_top_k = num_larger < top_k if top_k > 0 else np.ones_like(scaled, dtype=bool)
    probs = np.where(in_top_k, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    allowed, required = in_top_k.copy(), in_top_k.copy()
    if top_p < 1.0:
        mass_above = (np.where(probs[None, :] > probs[:, None], probs[None, :], 0.0)).sum(axis=1)
        mass_others_at_or_above = (
            np.where(probs[None, :] >= probs[:, None], probs[None, :], 0.0).sum(axis=1) - probs
        )
        allowed &= mass_above < top_p + tol
        required &= mass_others_at_or_above < top_p - tol
    if min_p > 0.0:
        allowed &= probs >= min_p * probs.max() * (1 - tol)
        required &= probs >= min_p * probs.max() * (1 + tol)
    return allowed, required


_logit_values = st.one_of(
    st.integers(-40, 40).map(lambda v: v / 5),  # a coarse grid: plenty of ties
    st.floats(-8.0, 8.0, allow_nan=False, width=32),
)
# Mostly ordinary fractions (hypothesis' float strategy favours edge values), plus edges.
_fractions = st.one_of(st.integers(1, 99).map(lambda v: v / 100), st.floats(0.0, 1.0))


@settings(max_examples=80, deadline=None)
@given(
    logit_list=st.lists(_logit_values, min_size=2, max_size=40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.9]),
    top_k=st.integers(-1, 45),
    top_p=st.one_of(st.just(1.0), _fractions.filter(lambda v: v > 0.0)),
    min_p=st.one_of(st.just(0.0), _fractions),
    rng_seed=st.integers(0, 2**16),
)
def test_filters_never_leave_their_support(
    logit_list: list[float], temperature: float, top_k: int, top_p: float, min_p: float,
    rng_seed: int,
) -> None:
    num_rows = 16
    logits = torch.tensor(logit_list, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    metadata = _metadata([params] * num_rows)
    allowed, required = _expected_support(logits, temperature, top_k, top_p, min_p)

    probs = compute_probs(logits.expand(num_rows, -1), metadata)[0].numpy()
    assert (probs[~allowed] == 0).all()
    assert (probs[required] > 0).all()
    with torch.random.fork_rng():
        torch.manual_seed(rng_seed)
        sampled = Sampler()(logits.expand(num_rows, -1), metadata).sampled_token_ids
    assert allowed[sampled.numpy()].all()


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_n_sorted() -> None:
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, repetition_penalty=1.5, temperature=0.5),
        SamplingParams(logprobs=3, top_k=2),
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    logits = _logits(len(params))
    metadata = _metadata(params, _histories(len(params)))
    assert metadata.max_num_logprobs == 5
    out = Sampler()(logits, metadata)
    raw = logits.log_softmax(dim=1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1))

    assert out.top_logprobs is not None and out.top_logprob_token_ids is not None
    assert out.top_logprobs.shape == (4, 5) and out.top_logprob_token_ids.dtype == torch.int64
    assert (out.top_logprobs[:, 1:] <= out.top_logprobs[:, :-1]).all()
    expected_ids = np.argsort(-raw.double().numpy(), axis=1, kind="stable")[:, :5]
    assert np.array_equal(out.top_logprob_token_ids.numpy(), expected_ids)
    assert torch.equal(out.top_logprobs, raw.gather(1, out.top_logprob_token_ids))


def test_chosen_only_logprobs_have_no_top_n() -> None:
    out = Sampler()(_logits(2), _metadata([SamplingParams(logprobs=0), SamplingParams()]))
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprobs is None and out.top_logprob_token_ids is None


# --------------------------------------------------------------------------- distribution


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=6, top_p=0.8)],
    ids=["softmax", "top_k_top_p"],
)
def test_empirical_distribution_matches_chi_square(params: SamplingParams) -> None:
    num_samples, vocab_size = 20_000, 12
    logits = _logits(1, vocab_size=vocab_size, seed=5)[0] / 2.0
    metadata = _metadata([params] * num_samples)
    expected_probs = compute_probs(logits.unsqueeze(0), _metadata([params]))[0].double()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        sampled = Sampler()(logits.expand(num_samples, -1), metadata).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab_size).double()
    support = expected_probs > 0
    assert counts[~support].sum() == 0
    expected_counts = expected_probs[support] / expected_probs[support].sum() * num_samples
    result = stats.chisquare(counts[support].numpy(), expected_counts.numpy())
    assert result.pvalue > 0.001


# --------------------------------------------------------------------------- validation


def test_build_rejects_bad_input() -> None:
    params = [SamplingParams(seed=1)]
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build(params, [], [None], CPU)
    with pytest.raises(ValueError, match="no generator"):
        SamplingMetadata.build(params, [[1]], [None], CPU)
    with pytest.raises(ValueError, match="non-negative"):
        SamplingMetadata.build([SamplingParams(repetition_penalty=1.1)], [[1, -2]], [None], CPU)
    metadata = _metadata([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(_logits(3), metadata)
