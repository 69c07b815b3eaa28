"""Constrained decoding in the engine (bundled 4-layer model, its 4096-token tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import regex
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.constraints import Constraint, ConstraintError, ConstraintKind
from engine.spec_decode.config import SpeculativeConfig

MODEL = Path(__file__).resolve().parents[2] / "models" / "target"
PATTERN = r"[0-9]{3}-[a-z]{2,4}"


def make_engine(**kw: object) -> Engine:
    return Engine(EngineConfig(model=str(MODEL), dtype="float32", num_kv_blocks=256, **kw))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def regex_params(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, constraint=Constraint(ConstraintKind.REGEX, PATTERN), **kw)


def test_unconstrained_row_unchanged_beside_a_constrained_one(engine: Engine) -> None:
    prompts = ["def main():", "import os\nimport sys\n"]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = engine.generate(prompts[1], free)[0]
    mixed = engine.generate(prompts, [regex_params(), free])
    assert mixed[1].token_ids == alone.token_ids
    assert regex.fullmatch(PATTERN, engine.tokenizer.decode(mixed[0].token_ids, skip_special_tokens=True))
    assert mixed[0].finish_reason == "stop"
    engine.check_integrity()


def test_choice_always_yields_a_choice(engine: Engine) -> None:
    choices = ("yes", "no", "maybe later")
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=16,
                             constraint=Constraint(ConstraintKind.CHOICE, choices=choices)) for s in range(12)]
    outs = engine.generate(["Answer: "] * len(params), params)
    texts = [engine.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert all(t in choices for t in texts), texts
    assert all(o.finish_reason == "stop" for o in outs)
    engine.check_integrity()


def _allowed(tokenizer: object, text: str, vocab_size: int, eos_id: int) -> list[int]:
    """Tokens after which the text can still become a full match of PATTERN, and EOS when the
    text already is one: the mask, by hand."""
    allowed = [t for t in range(vocab_size)
               if regex.fullmatch(PATTERN, text + tokenizer.decode([t]), partial=True) is not None]
    if regex.fullmatch(PATTERN, text):
        allowed.append(eos_id)
    return allowed


def test_greedy_under_regex_is_argmax_over_allowed_tokens(engine: Engine) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    prompt = engine.tokenize("The code is ")
    eos_id = engine.eos_token_ids[0]
    tokens: list[int] = []
    for _ in range(24):
        allowed = _allowed(engine.tokenizer, engine.tokenizer.decode(tokens), engine.spec.vocab_size, eos_id)
        if set(allowed) <= {eos_id} and tokens:
            break  # the grammar is complete: the engine stops without sampling EOS
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        tokens.append(int(masked.argmax()))
        if tokens[-1] == eos_id:
            break
    out = engine.generate(prompt, regex_params())[0]
    assert out.token_ids == tokens
    assert out.finish_reason == "stop"


def test_json_schema_reply_parses_and_length_cut_says_length(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "size": {"enum": ["S", "M", "L"]}}, "required": ["name", "size"]}
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), strict=True)
    out = engine.generate("{", SamplingParams(temperature=0.0, max_tokens=64, constraint=constraint))[0]
    reply = json.loads(engine.tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert out.finish_reason == "stop" and set(reply) == {"name", "size"} and reply["size"] in "SML"
    cut = engine.generate("{", SamplingParams(temperature=0.0, max_tokens=3, constraint=constraint))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    engine.check_integrity()


def test_speculation_keeps_greedy_constrained_output(engine: Engine) -> None:
    spec = make_engine(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"},
                         "maxItems": 6}}, "required": ["a"]})
    params = [regex_params(), SamplingParams(temperature=0.0, max_tokens=48,
                                             constraint=Constraint(ConstraintKind.JSON_SCHEMA, schema))]
    prompts = ["123-ab 123-ab 123-ab 123-", '{"a": [1, 1, 1, 1, 1], "a": [1, 1']
    base = engine.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert spec.spec_stats.num_draft_tokens > 0
    spec.check_integrity()


def test_prefilled_and_migrated_requests_rebuild_the_matcher(engine: Engine) -> None:
    """The decode side rebuilds the matcher from the first token (and a migrated request's
    earlier tokens): no grammar state is shipped, the output equals one engine's."""
    from tests.engine.test_engine_disagg import run_split

    prompt = engine.tokenize("The code is ")
    params = regex_params()
    whole = engine.generate(prompt, params)[0]
    prefill, decode = make_engine(), make_engine()
    split = run_split(prefill, decode, [prompt], params)[0]
    assert split.token_ids == whole.token_ids and split.finish_reason == "stop"
    # Migration: the new worker gets the prompt plus the tokens already delivered.
    delivered = whole.token_ids[:3]
    resumed = run_split(prefill, decode, [prompt + delivered], params, num_prior_draws=3)[0]
    assert delivered + resumed.token_ids == whole.token_ids
    prefill.check_integrity()
    decode.check_integrity()


@pytest.mark.parametrize("kind,text,reason", [
    (ConstraintKind.REGEX, "[a-", "unclosed character class"),
    (ConstraintKind.GRAMMAR, "start: foo", "unknown name"),
    (ConstraintKind.JSON_SCHEMA, '{"type": "objectx"}', "objectx"),
])
def test_invalid_constraint_fails_with_the_library_reason(engine: Engine, kind: ConstraintKind,
                                                          text: str, reason: str) -> None:
    assert engine.grammars is not None
    with pytest.raises(ConstraintError, match=reason):
        engine.grammars.compile(Constraint(kind, text))


@pytest.mark.parametrize("kwargs,message", [
    ({"kind": ConstraintKind.JSON_SCHEMA, "text": "[" * 40 + "]" * 40}, "nests 40 levels"),
    ({"kind": ConstraintKind.JSON_SCHEMA, "text": "{" + " " * (1 << 20) + "}"}, "bytes; the limit"),
    ({"kind": ConstraintKind.JSON_SCHEMA, "text": "{nope"}, "not valid JSON"),
    ({"kind": ConstraintKind.CHOICE, "choices": tuple(str(i) for i in range(1000))}, "limit is 256"),
    ({"kind": ConstraintKind.REGEX, "text": ""}, "must not be empty"),
])
def test_caps_are_checked_before_compiling(kwargs: dict, message: str) -> None:
    with pytest.raises(ConstraintError, match=message):
        Constraint(**kwargs)


def test_forbidden_tokens_follow_llguidance_bit_order() -> None:
    from engine.grammar_masks import forbidden_tokens

    allowed = [0, 5, 31, 32, 63, 64, 100]
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    for t in allowed:
        word = int(bitmask[0, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
        bitmask[0, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    forbidden = forbidden_tokens(bitmask, 101)
    assert forbidden.shape == (1, 101)
    assert [t for t in range(101) if not forbidden[0, t]] == allowed


def test_sampled_speculation_only_emits_what_the_grammar_allows() -> None:
    """Sampling with n-gram drafts: forbidden drafts are rejected and the verifier samples
    the masked distribution, so every reply still matches (prompts repeat non-matching text,
    so the drafts often propose forbidden tokens)."""
    spec = make_engine(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, constraint=Constraint(ConstraintKind.REGEX, PATTERN))
              for s in range(8)]
    prompts = ["123-ab xyz 123-ab xyz 123-ab xyz 123-", "aaaa-1111 aaaa-1111 aaaa"] * 4
    outs = spec.generate(prompts, params)
    texts = [spec.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert all(o.finish_reason == "stop" and regex.fullmatch(PATTERN, t) for o, t in zip(outs, texts)), texts
    assert spec.spec_stats.num_draft_tokens > 0
    spec.check_integrity()
