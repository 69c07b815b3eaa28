"""Speculative decoding through the engine: greedy identity, acceptance, KV hygiene, and
the target distribution preserved when sampling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposers import DraftModelProposer, NgramDraftProposer
from tests.conftest import mixed_prompts
from tests.engine.test_engine_parity import make_engine

NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def repetitive_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short motif, so n-gram lookup finds matches."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(num):
        motif = torch.randint(3, 500, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append((motif * 40)[: 20 + 13 * i])
    return prompts


def spec_engine(path: Path, spec: SpeculativeConfig, **kw: object) -> Engine:
    return make_engine(path, speculative=spec, **kw)


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_greedy_identical(k: int, ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompts = repetitive_prompts(8, seed=k) + mixed_prompts(4, 512, seed=3, max_len=60)
    base = make_engine(path).generate(prompts, GREEDY)
    engine = spec_engine(path, SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_batch_size=16))
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_draft_equal_to_target_accepts_everything(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("qwen3")
    prompts = mixed_prompts(6, 512, seed=9, max_len=100)
    base = make_engine(path).generate(prompts, GREEDY)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=3)
    engine = spec_engine(path, spec)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # 100% acceptance
    engine.check_integrity()


def test_unrelated_draft_rejected_but_output_identical(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    draft = ckpt_dir("llama", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=64, _seed=99)
    prompts = mixed_prompts(8, 512, seed=17, max_len=150)
    base = make_engine(path).generate(prompts, GREEDY)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(draft), num_speculative_tokens=4)
    engine = spec_engine(path, spec)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 50
    assert stats.acceptance_rate < 0.1
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_preemption_and_abort_while_speculating(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("qwen2")
    draft = ckpt_dir("qwen2", num_hidden_layers=1, _seed=5)
    prompts = mixed_prompts(10, 512, seed=13, max_len=120)
    base = make_engine(path).generate(prompts, GREEDY)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(draft), num_speculative_tokens=4, max_batch_size=16)
    engine = spec_engine(path, spec, num_kv_blocks=20, max_num_batched_tokens=256)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert engine.stats.num_preemptions > 0 and engine.spec_stats.num_draft_tokens > 0
    engine.check_integrity()
    assert engine.num_free_blocks == 20
    # Abort a request in the middle of speculation: every block comes back.
    rid = engine.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    other = engine.add_request(prompts[4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not engine.scheduler.requests[rid].spec_token_ids:
        engine.step()
    assert engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.num_free_blocks == 20 and other not in engine.scheduler.requests


def test_per_request_k_and_opt_out(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("llama")
    prompt = repetitive_prompts(1, seed=1)[0]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    engine = spec_engine(path, spec)
    off = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, num_speculative_tokens=0))[0]
    assert off.num_draft_tokens == 0
    one = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, num_speculative_tokens=1))[0]
    assert one.token_ids == off.token_ids and one.num_draft_tokens > 0
    assert engine.spec_stats.accepted_per_position[1:] == [0] * (len(engine.spec_stats.accepted_per_position) - 1)
    engine.check_integrity()


def test_blocks_filled_by_accepted_drafts_are_published_under_their_tokens(ckpt_dir: Callable[..., Path]) -> None:
    """The prefix cache publishes a block once its tokens are known: a follow-up prompt that
    resends prompt + answer hits every block the speculating request computed (accepted
    drafts count as computed before they join the tokens)."""
    from engine.block_hash import prompt_block_hashes

    engine = spec_engine(ckpt_dir("llama"), SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    for prompt in repetitive_prompts(3, seed=2):  # the first crosses a block boundary with drafts
        (out,) = engine.generate([prompt], GREEDY)
        assert out.num_accepted_tokens > 0
        computed = prompt + out.token_ids[:-1]  # the last token's K/V is never computed
        assert set(prompt_block_hashes([*computed, 0], 16)) <= set(engine.kv.pool.cached)
        (follow,) = engine.generate([prompt + out.token_ids + [7, 8, 9]], GREEDY)
        assert follow.num_cached_tokens == len(computed) // 16 * 16
        engine.check_integrity()


def _marginal_second_token(path: Path, prompt: list[int]) -> torch.Tensor:
    """Exact P(t2) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1) of a model, at temperature 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        vocab = p1.shape[0]
        seqs = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = model(seqs).logits[:, -1].softmax(-1)  # [V, V]: row t1
    return (p1 @ p2).double()


def _marginal_first_token(path: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].softmax(-1).double()


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    keep = expected >= 5  # pool the sparse tail into one cell
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)]).numpy()
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)]).numpy()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("method", ["draft_model", "ngram", "ngram_draft"])
def test_sampling_preserves_target_distribution(method: str, ckpt_dir: Callable[..., Path]) -> None:
    vocab = 32
    path = ckpt_dir("llama", vocab_size=vocab, _seed=31)
    draft = ckpt_dir("llama", vocab_size=vocab, num_hidden_layers=1, _seed=77)
    # Every token occurs in the prompt, so n-gram lookup proposes a draft after any first token.
    prompt = list(range(vocab)) + [5, 9, 3]
    target_marginal = _marginal_second_token(path, prompt)
    # ngram_draft with ngram_min=2: lookup drafts after t1 = 4 (the pair [3, 4] recurs),
    # the draft model after every other t1, so both kinds of rows verify in one batch.
    spec = SpeculativeConfig(method=method, draft_model=str(draft) if method != "ngram" else None,
                             num_speculative_tokens=1, max_batch_size=4096,
                             ngram_min=2 if method == "ngram_draft" else None)
    engine = make_engine(path, speculative=spec, num_kv_blocks=4096, max_num_seqs=1024,
                         max_num_batched_tokens=16384, max_model_len=64)
    torch.manual_seed(2024)
    num_samples = 20_000
    outs = engine.generate([prompt] * num_samples, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    second = torch.tensor([o.token_ids[1] for o in outs])
    counts = torch.bincount(second, minlength=vocab).double()
    assert engine.spec_stats.num_draft_tokens >= num_samples * 9 // 10  # the 2nd token was speculated
    assert _chi_square_p(counts, target_marginal) > 0.001
    # The test has power: the draft's (or the n-gram's) proposal distribution is rejected.
    if method == "draft_model":
        assert _chi_square_p(counts, _marginal_second_token(draft, prompt)) < 0.001
    elif method == "ngram":  # n-gram drafts: the token after t1's last occurrence in the prompt, i.e. t1 + 1
        p1 = _marginal_first_token(path, prompt)
        proposal = torch.roll(p1, 1)  # P(draft = t1 + 1)
        assert _chi_square_p(counts, proposal) < 0.001
    engine.check_integrity()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch1_draft_path_proposes_what_the_batched_path_does(
    temperature: float, ckpt_dir: Callable[..., Path]
) -> None:
    """One request goes through the draft's lean single-sequence forward; the same request
    through the batched path gets the same drafts (and, sampling, the same draft_probs)."""
    path = ckpt_dir("llama")
    draft = ckpt_dir("llama", num_hidden_layers=1, _seed=5)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(draft), num_speculative_tokens=4)
    engine = spec_engine(path, spec)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True)
    rid = engine.add_request(mixed_prompts(5, 512, seed=4, max_len=40)[4], params)
    proposer = engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    before: list[tuple[int, torch.Tensor]] = []
    propose = proposer.propose

    def recording_propose(requests: list, ks: list[int], block_ids: dict[str, list[int]]) -> None:
        before.append((requests[0].draft_num_computed, requests[0].generator.get_state()))
        propose(requests, ks, block_ids)

    proposer.propose = recording_propose  # type: ignore[method-assign]
    for _ in range(6):
        engine.step()
    request = engine.scheduler.requests[rid]
    lean = (request.spec_token_ids, request.draft_probs, request.draft_num_computed)
    request.draft_num_computed, generator_state = before[-1]
    request.generator.set_state(generator_state)
    with torch.inference_mode():
        proposer._propose_batch([request], [len(lean[0])], {rid: engine.kv.block_ids(rid)})
    assert lean[0] == request.spec_token_ids and len(lean[0]) == 4
    assert lean[2] == request.draft_num_computed
    if temperature == 0.0:
        assert lean[1] is None  # greedy drafts carry no distribution
    else:
        torch.testing.assert_close(lean[1], request.draft_probs, rtol=1e-5, atol=1e-6)


def test_batch1_draft_path_greedy_identical_one_request_at_a_time(ckpt_dir: Callable[..., Path]) -> None:
    path = ckpt_dir("qwen3")
    prompts = mixed_prompts(4, 512, seed=21, max_len=90)
    base = make_engine(path).generate(prompts, GREEDY)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=3)
    engine = spec_engine(path, spec)
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]  # batch 1: the lean path
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_ngram_draft_uses_lookup_where_the_context_repeats(ckpt_dir: Callable[..., Path]) -> None:
    """Repetitive prompts get lookup drafts, random ones the draft model's; greedy output
    is unchanged either way, at batch 1 (lean draft path) and batched."""
    path = ckpt_dir("llama")
    draft = ckpt_dir("llama", num_hidden_layers=1, _seed=5)
    prompts = repetitive_prompts(3, seed=2) + mixed_prompts(5, 512, seed=8, min_len=20, max_len=80)
    base = make_engine(path).generate(prompts, GREEDY)
    spec = SpeculativeConfig(method="ngram_draft", draft_model=str(draft), num_speculative_tokens=4,
                             max_batch_size=16)
    assert spec.min_ngram_len == 3
    engine = spec_engine(path, spec)
    assert isinstance(engine.proposer, NgramDraftProposer)
    proposer = engine.proposer
    by_lookup: list[str] = []
    by_draft: list[str] = []
    ngram_propose, draft_propose = proposer.ngram.propose, proposer.draft.propose

    lookup_lens: list[int] = []

    def lookup(requests: list, ks: list[int], block_ids: dict[str, list[int]]) -> None:
        ngram_propose(requests, ks, block_ids)
        by_lookup.extend(r.request_id for r in requests if r.spec_token_ids)
        lookup_lens.extend(len(r.spec_token_ids) for r in requests if r.spec_token_ids)

    def draft_model(requests: list, ks: list[int], block_ids: dict[str, list[int]]) -> None:
        assert not any(r.spec_token_ids for r in requests)  # only what lookup left
        assert max(ks) <= 4  # the draft model's k
        by_draft.extend(r.request_id for r in requests)
        draft_propose(requests, ks, block_ids)

    proposer.ngram.propose = lookup  # type: ignore[method-assign]
    proposer.draft.propose = draft_model  # type: ignore[method-assign]
    batched = engine.generate(prompts, GREEDY)
    one_by_one = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in base]
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in base]
    random_ids = {o.request_id for o in batched[3:] + one_by_one[3:]}
    assert by_lookup and random_ids <= set(by_draft)  # both proposers served
    assert max(lookup_lens) == spec.lookup_len == 8  # lookup runs to 2k
    assert engine.spec_stats.num_accepted_tokens > 0
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_lookup_len_defaults_by_method() -> None:
    assert (SpeculativeConfig(method="ngram").lookup_len, SpeculativeConfig(method="ngram").max_num_drafts) == (4, 4)
    hybrid = SpeculativeConfig(method="ngram_draft", draft_model="d", num_speculative_tokens=5)
    assert (hybrid.lookup_len, hybrid.max_num_drafts) == (10, 10)
    assert SpeculativeConfig(method="ngram_draft", draft_model="d", num_speculative_tokens=12).lookup_len == 16
    assert SpeculativeConfig(method="ngram_draft", draft_model="d", num_lookup_tokens=2).max_num_drafts == 4
    assert SpeculativeConfig(method="draft_model", draft_model="d", num_lookup_tokens=9).max_num_drafts == 4
    with pytest.raises(ValueError, match="num_lookup_tokens"):
        SpeculativeConfig(num_lookup_tokens=17)


def test_ngram_min_defaults_by_method() -> None:
    assert SpeculativeConfig(method="ngram").min_ngram_len == 1
    assert SpeculativeConfig(method="ngram_draft", draft_model="d").min_ngram_len == 3
    assert SpeculativeConfig(method="ngram_draft", draft_model="d", ngram_min=2).min_ngram_len == 2
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="ngram_draft")
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram_draft", draft_model="d", ngram_max=2)  # default min 3 > max


def test_draft_runs_on_one_intra_op_thread(ckpt_dir: Callable[..., Path]) -> None:
    """The draft's tiny ops run single-threaded; the engine's thread count comes back."""
    path = ckpt_dir("llama")
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=2)
    try:
        engine = spec_engine(path, spec, num_threads=2)
        proposer = engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        seen: list[int] = []
        forward_sequence = proposer.model.forward_sequence

        def recording(*args: object) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return forward_sequence(*args)  # type: ignore[arg-type]

        proposer.model.forward_sequence = recording  # type: ignore[method-assign]
        engine.generate([mixed_prompts(5, 512, seed=2, max_len=30)[4]], GREEDY)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)  # the suite's setting (conftest)
