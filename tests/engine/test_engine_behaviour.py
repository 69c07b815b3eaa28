"""Engine behaviour beyond parity: prefix caching, bad input, abort, dtype, detokenization."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, RequestOutput, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from tests.helpers.outputs import Completions
from tests.engine.test_engine_parity import GREEDY, NEW_TOKENS, make_engine


def test_prefix_cache_computes_only_the_suffix(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama")
    prefix = [(7 * i) % 500 + 3 for i in range(200)]
    first = prefix + [11, 12, 13, 14, 15]
    second = prefix + [21, 22, 23]
    engine = make_engine(path)
    engine.generate([first], GREEDY)
    before = engine.stats.num_prefill_tokens
    out = engine.generate([second], GREEDY)[0]
    # 200 shared tokens = 12 full blocks of 16 (192 tokens) served from the cache.
    assert out.num_cached_tokens == 192
    assert engine.stats.num_prefill_tokens - before == len(second) - 192
    assert out.token_ids == hf_greedy(path, [second], NEW_TOKENS)[0]
    engine.check_integrity()


def test_prefix_caching_off_computes_everything(ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"), enable_prefix_caching=False)
    prompt = list(range(3, 100))
    engine.generate([prompt, prompt], GREEDY)
    assert engine.stats.num_prefill_tokens == 2 * len(prompt)
    engine.check_integrity()


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_input_keeps_engine_serving(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama")
    engine = make_engine(path, max_model_len=128)
    good = list(range(5, 40))
    rid = engine.add_request(good, GREEDY)
    collected = Completions()
    collected.feed(engine.step())  # the good request is running when the bad ones arrive
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(list(range(3, 200)), GREEDY)  # longer than max_model_len
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([1, 2, 10_000], GREEDY)  # outside the vocabulary
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("text", GREEDY)  # random checkpoint: no tokenizer
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(good, SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(99_999,)))
    while engine.has_unfinished_requests():
        collected.feed(engine.step())
    assert collected[rid].finished and collected[rid].token_ids == hf_greedy(path, [good], NEW_TOKENS)[0]
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_unknown_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        Engine(EngineConfig(model=str(tmp_path / "missing")))


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        Engine(EngineConfig(model=str(tmp_path)))


@pytest.mark.parametrize("kwargs,field", [(dict(block_size=12), "block_size"), (dict(dtype="int8"), "dtype"),
                                          (dict(max_num_seqs=0), "max_num_seqs")])
def test_bad_engine_config(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="x", **kwargs)


def test_abort_frees_blocks_mid_generation(ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"))
    a = engine.add_request(list(range(3, 150)), SamplingParams(temperature=0.0, max_tokens=50))
    b = engine.add_request(list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=5))
    collected = Completions()
    for _ in range(3):
        collected.feed(engine.step())
    assert engine.abort(a)
    assert not engine.abort(a)  # second abort: unknown
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in collected.feed(engine.step())})
    assert list(finished) == [b] and len(finished[b].token_ids) == 5
    engine.check_integrity()
    assert engine.num_free_blocks == 512


def test_max_model_len_stops_with_length(ckpt_dir: Callable[..., Path]) -> None:
    engine = make_engine(ckpt_dir("llama"), max_model_len=64)
    out = engine.generate([list(range(3, 60))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 - 57 and out.finish_reason == "length"
    engine.check_integrity()


def test_stop_token_ids_finish_with_stop(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama")
    prompt = list(range(3, 40))
    expected = hf_greedy(path, [prompt], NEW_TOKENS)[0]
    stop = expected[4]
    engine = make_engine(path)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(stop,)))[0]
    assert out.token_ids == expected[: expected.index(stop) + 1]
    assert out.finish_reason == "stop"
    engine.check_integrity()


def test_bfloat16_runs_and_mostly_agrees(ckpt_dir: Callable[..., Path], hf_greedy: Callable) -> None:
    path = ckpt_dir("llama")
    prompt = list(range(3, 80))
    engine = make_engine(path, dtype="bfloat16")
    out = engine.generate([prompt], GREEDY)[0]
    expected = hf_greedy(path, [prompt], NEW_TOKENS)[0]
    assert len(out.token_ids) == NEW_TOKENS
    assert out.token_ids[0] == expected[0]  # bf16 rounding may diverge later, not at once
    engine.check_integrity()


class _ByteTokenizer:
    """Decodes token ids as UTF-8 bytes (exercises split multi-byte characters)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_holds_back_partial_characters() -> None:
    text = "héllo, wörld → ok"
    ids = list(text.encode("utf-8"))
    detok = IncrementalDetokenizer(_ByteTokenizer(), [])
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def _output_bytes(out: RequestOutput) -> int:
    """Bytes of what a step's output holds for its request (lists, their items, text)."""
    size = sys.getsizeof(out.new_token_ids) + sum(sys.getsizeof(t) for t in out.new_token_ids)
    size += sys.getsizeof(out.new_text)
    for values in (out.new_logprobs or [], out.new_top_logprobs or []):
        size += sys.getsizeof(values) + sum(sys.getsizeof(v) for v in values)
    for top in out.new_top_logprobs or []:
        size += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in top.items())
    return size


def test_output_bytes_per_step_do_not_grow_with_output_length(ckpt_dir: Callable[..., Path]) -> None:
    """Outputs carry deltas: a step's output for a running request is as large at token
    2,000 as at token 10 (cumulative outputs made each step O(length), a request O(L²))."""
    engine = make_engine(ckpt_dir("llama", max_position_embeddings=2048), max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, logprobs=2)
    rid = engine.add_request([5, 6, 7], params)
    sizes: dict[int, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid and len(out.new_token_ids) == 1
            sizes[out.num_output_tokens] = _output_bytes(out)
    assert len(sizes) == 2000
    assert {sizes[n] for n in range(10, 2001)} == {sizes[10]}
    engine.check_integrity()
