"""Seeded workloads: same seed, same requests; lengths inside their bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.workload import (
    FIRST_ORDINARY_ID,
    LengthDist,
    ModelShape,
    code_completion,
    code_prompts,
    code_source_files,
    conversations,
    count_parameters,
    ensure_model,
    long_mix,
    synthetic,
    tokenize_files,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "target"


def test_synthetic_is_seeded_and_bounded() -> None:
    prompt = LengthDist(4, 64, "lognormal", median=16, sigma=1.0)
    output = LengthDist(2, 8)
    first = synthetic(50, 7, 100, prompt, output)
    assert first == synthetic(50, 7, 100, prompt, output)
    assert first != synthetic(50, 8, 100, prompt, output)
    for req in first:
        assert 4 <= len(req.prompt_token_ids) <= 64
        assert 2 <= req.max_new_tokens <= 8
        assert all(FIRST_ORDINARY_ID <= t < 100 for t in req.prompt_token_ids)


def test_long_mix_tags_long_prompts() -> None:
    reqs = long_mix(200, 0, 100, LengthDist(4, 8), LengthDist(100, 120), LengthDist(4, 4), 0.25)
    kinds = [r.kind for r in reqs]
    assert set(kinds) == {"short", "long"}
    assert 0.1 < kinds.count("long") / len(kinds) < 0.4
    for req in reqs:
        bounds = (100, 120) if req.kind == "long" else (4, 8)
        assert bounds[0] <= len(req.prompt_token_ids) <= bounds[1]


def test_code_completion_cuts_windows_of_documents() -> None:
    docs = [list(range(1000, 1300)), list(range(5000, 5050)), list(range(2000, 2400))]
    reqs = code_completion(6, 3, docs, LengthDist(16, 64), LengthDist(8, 8))
    assert reqs == code_completion(6, 3, docs, LengthDist(16, 64), LengthDist(8, 8))
    for i, req in enumerate(reqs):
        doc = docs[0] if i % 2 == 0 else docs[2]  # the 50-token document is too short
        ids = list(req.prompt_token_ids)
        assert 16 <= len(ids) <= 64 and ids == list(range(ids[0], ids[0] + len(ids)))
        assert ids[0] in doc and ids[-1] in doc
    with pytest.raises(ValueError):
        code_completion(1, 0, [list(range(10))], LengthDist(16, 64), LengthDist(8, 8))


def test_code_source_is_held_out_text() -> None:
    files, description = code_source_files(MODEL)
    assert files and all(f.suffix == ".py" for f in files)
    assert "held-out" in description or "repository" in description
    docs = tokenize_files(MODEL, files[:2])
    assert all(len(doc) > 0 for doc in docs)


def test_length_dist_validation() -> None:
    with pytest.raises(ValueError):
        LengthDist(0, 4)
    with pytest.raises(ValueError):
        LengthDist(4, 8, "lognormal")
    with pytest.raises(ValueError):
        LengthDist(4, 8, "zipf")


def test_code_source_falls_back_to_the_installed_packages(tmp_path: Path) -> None:
    """No training report beside the model: the project's own source, found by import (so a
    wheel install has it too), not through a checkout's path."""
    files, description = code_source_files(tmp_path / "model")
    assert "own Python source" in description
    import engine.engine
    import splitserve.cli

    assert Path(engine.engine.__file__) in files and Path(splitserve.cli.__file__) in files
    with pytest.raises(ValueError, match="tokenizer.json"):
        tokenize_files(tmp_path, files[:1])


def test_code_prompts_are_windows_of_the_held_out_text() -> None:
    requests, source = code_prompts(MODEL, 4, 0, LengthDist(16, 32), LengthDist(8, 8))
    assert "held-out" in source
    assert [r.max_new_tokens for r in requests] == [8] * 4
    docs = tokenize_files(MODEL, code_source_files(MODEL)[0])
    for req in requests:
        ids = list(req.prompt_token_ids)
        assert 16 <= len(ids) <= 32
        assert any(doc[i:i + len(ids)] == ids for doc in docs for i in range(len(doc) - len(ids) + 1))


def test_ensure_model_makes_then_reuses_a_seeded_model(tmp_path: Path) -> None:
    shape = ModelShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=64, max_position_embeddings=64, initializer_range=0.15)
    path = ensure_model(tmp_path / "m", shape, seed=3)
    assert path == (tmp_path / "m").resolve() and path.is_absolute()
    weights = path / "model.safetensors"
    made = weights.stat().st_mtime_ns
    assert ensure_model(tmp_path / "m", shape, seed=3) == path and weights.stat().st_mtime_ns == made
    assert count_parameters(path) == 2 * 64 * 32 + 32 * 32 * 2 + 2 * 32 * 16 + 3 * 32 * 64 + 3 * 32
    before = weights.read_bytes()
    ensure_model(tmp_path / "m", shape, seed=4)  # another seed: made again, other weights
    assert weights.read_bytes() != before


def test_conversations_share_system_prompts_and_resend_the_whole_history() -> None:
    args = (5, 3, 2, 11, 100, LengthDist(20, 30), LengthDist(4, 6), LengthDist(2, 3))
    convs = conversations(*args)
    assert convs == conversations(*args) and convs != conversations(5, 3, 2, 12, *args[4:])
    assert [c.system_index for c in convs] == [0, 1, 0, 1, 0]
    assert convs[0].system == convs[2].system != convs[1].system
    conv = convs[3]
    assert all(4 <= len(u) <= 6 for u in conv.user_turns) and all(2 <= n <= 3 for n in conv.answer_lens)
    answers = [[90 + t] * n for t, n in enumerate(conv.answer_lens)]
    assert conv.prompt(0, []) == (*conv.system, *conv.user_turns[0])
    assert conv.prompt(2, answers[:2]) == (*conv.system, *conv.user_turns[0], *answers[0],
                                           *conv.user_turns[1], *answers[1], *conv.user_turns[2])
    assert conv.max_tokens() == len(conv.prompt(2, answers[:2])) + conv.answer_lens[2]
    with pytest.raises(ValueError, match="earlier answers"):
        conv.prompt(1, [])
    with pytest.raises(ValueError, match="num_system_prompts"):
        conversations(2, 1, 3, 0, 100, LengthDist(1, 1), LengthDist(1, 1), LengthDist(1, 1))
