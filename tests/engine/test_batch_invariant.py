"""``EngineConfig.batch_invariant``: a request's tokens and logprobs are the same bits alone
and beside a long prompt, greedy and seeded. The long prompt makes the first step 320 rows,
past the 129 from which the AVX-512 library hands float32 linears to oneDNN by default, whose
sums then run in another order: without the setting, on the Zen 5 this was written on, the
logprobs differed in their last bits (at the tiny model's widths oneDNN's sums happened to
agree, hence ``WIDE``). The AVX2 library runs the panel GEMM at every row count either way.
Also what the setting refuses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from splitserve_kernels.native import native_kernels
from tests.engine.test_engine_parity import make_engine

PROMPT = list(range(10, 30))
LONG = [(7 * i) % 240 + 5 for i in range(300)]  # with PROMPT: a first step of 320 rows
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True, logprobs=2)

# Wide enough that oneDNN's sums differ from the panels' (at the tiny model's widths they agree).
WIDE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2)

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="needs the native panel GEMM")


def _alone_and_beside(path: Path, params: SamplingParams, **config: object) -> tuple[tuple, tuple]:
    def seen(out: object) -> tuple:
        return out.token_ids, out.logprobs, out.top_logprobs  # type: ignore[attr-defined]

    alone = make_engine(path, **config).generate([PROMPT], params)[0]
    beside = make_engine(path, **config).generate([PROMPT, LONG], [params, SamplingParams(max_tokens=8)])[0]
    return seen(alone), seen(beside)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_same_bits_alone_and_beside_a_long_prompt(ckpt_dir: Callable[..., Path], params: SamplingParams) -> None:
    alone, beside = _alone_and_beside(ckpt_dir("llama", **WIDE), params, batch_invariant=True)
    assert alone == beside


@pytest.mark.parametrize("field, value", [
    ("dtype", "bfloat16"), ("device", "cuda"), ("quantization", "int8"),
    ("speculative", SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
])
def test_what_it_refuses_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"batch_invariant (needs {field}|refuses speculative)"):
        EngineConfig(model="m", batch_invariant=True, **{field: value})


def test_refused_at_load_without_the_panel_gemm(ckpt_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.models.llama as llama

    monkeypatch.setattr(llama, "panel_gemm", lambda: False)  # as with the torch references
    with pytest.raises(ValueError, match="batch_invariant needs the native library's panel GEMM"):
        make_engine(ckpt_dir("llama"), batch_invariant=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_prefilled_continuation_is_the_unbroken_stream_bit_for_bit(ckpt_dir: Callable[..., Path],
                                                                    kv_cache_dtype: str) -> None:
    # What a migration, a resumed stream and a preempted request's recompute do: prefill the
    # prompt and the tokens already sent, then go on. The prompt rows are attended as decode
    # rows are, so what follows is the unbroken stream's tokens and logprobs, bit for bit.
    engine = make_engine(ckpt_dir("llama", **WIDE), batch_invariant=True, enable_prefix_caching=False,
                         kv_cache_dtype=kv_cache_dtype)
    unbroken = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                        logprobs=2))[0]
    for sent in (1, 8, 15):
        rest = engine.generate([PROMPT + unbroken.token_ids[:sent]], SamplingParams(
            temperature=0.0, max_tokens=16 - sent, ignore_eos=True, logprobs=2))[0]
        assert (rest.token_ids, rest.logprobs, rest.top_logprobs) == (
            unbroken.token_ids[sent:], unbroken.logprobs[sent:], unbroken.top_logprobs[sent:]), sent
