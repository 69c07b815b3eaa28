"""The bundled model pair through our engine is token-identical to transformers."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

MODELS = Path(__file__).resolve().parents[2] / "models"
NEW_TOKENS = 24


def heldout_prompts(num: int, length: int) -> list[list[int]]:
    """Token-id prefixes of the stdlib files the models never trained on."""
    from transformers import AutoTokenizer

    report = json.loads((MODELS / "train_report.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    tokenizer.model_max_length = 1 << 30  # whole files are tokenized, then cut
    prompts = []
    for rel in report["corpus"]["heldout_files"]:
        path = stdlib / rel
        if path.is_file():
            ids = tokenizer.encode(path.read_text(errors="replace"))
            if len(ids) >= length:
                prompts.append(ids[: length - 7 * len(prompts)])  # mixed lengths
        if len(prompts) == num:
            break
    assert len(prompts) == num, "held-out files missing from this Python's stdlib"
    return prompts


@pytest.mark.parametrize("role", ["target", "draft"])
def test_bundled_model_greedy_matches_transformers(role: str) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = MODELS / role
    prompts = heldout_prompts(4, 120)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    engine.check_integrity()


def test_bundled_pair_speculative_greedy_identical() -> None:
    from engine.spec_decode.config import SpeculativeConfig

    prompts = heldout_prompts(4, 120)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    base = Engine(EngineConfig(model=str(MODELS / "target"), num_kv_blocks=256)).generate(prompts, params)
    spec = SpeculativeConfig(method="draft_model", draft_model=str(MODELS / "draft"), num_speculative_tokens=4)
    engine = Engine(EngineConfig(model=str(MODELS / "target"), num_kv_blocks=256, speculative=spec))
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert engine.spec_stats.num_accepted_tokens > 0
    engine.check_integrity()


def test_text_prompt_streams_text() -> None:
    engine = Engine(EngineConfig(model=str(MODELS / "target"), num_kv_blocks=64))
    rid = engine.add_request("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=16))
    text = ""
    final = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
            token_ids += out.new_token_ids
            final = out
    assert final is not None and final.request_id == rid and final.finished
    assert len(token_ids) >= 1 and text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    engine.check_integrity()
