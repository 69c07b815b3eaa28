"""GGUF checkpoints: tensor types, names and q/k layout, tokenizer, errors (files written here)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.gguf_reader import open_gguf
from engine.models.gguf_weights import SUPPORTED_TENSOR_TYPES, dequantize
from engine.models.loader import load_weights
from engine.models.spec import load_model_spec, load_tokenizer
from tests.engine.gguf_files import ENCODERS, checkpoint_to_gguf, encode_blocks, write_tensors, write_vocabulary

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "target"
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def _tensor(path: Path, name: str) -> object:
    return next(t for t in open_gguf(str(path)).reader.tensors if t.name == name)


@pytest.mark.parametrize("qtype", sorted(ENCODERS))
def test_each_quantized_type_reads_back_as_its_blocks_say(qtype: str, tmp_path: Path) -> None:
    raw, expected = encode_blocks(qtype, np.random.default_rng(len(qtype)), rows=3, blocks_per_row=2)
    path = write_tensors(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    got = dequantize(_tensor(path, "blk.0.ffn_up.weight"))
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types_read_back_exactly(qtype: str, tmp_path: Path) -> None:
    import gguf

    values = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    if qtype == "F16":
        values = values.astype(np.float16).astype(np.float32)
        data = values.astype(np.float16)
    elif qtype == "BF16":
        values = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
    else:
        data = values
    path = write_tensors(tmp_path / "f.gguf", {"output_norm.weight": (data, qtype)})
    assert np.array_equal(dequantize(_tensor(path, "output_norm.weight")), values)


def test_every_supported_type_is_tested() -> None:
    assert set(SUPPORTED_TENSOR_TYPES) == set(ENCODERS) | {"F32", "F16", "BF16"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_of_a_checkpoint_runs_as_the_checkpoint(arch: str, tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    """F32 GGUF (q/k rows permuted as llama.cpp writes them) == the HF checkpoint, and
    transformers' own GGUF loader reads our file as the same model."""
    src = ckpt_dir(arch)
    path = checkpoint_to_gguf(src, tmp_path / f"{arch}.gguf")
    want = load_model_spec(str(src))
    # GGUF stores the epsilon as a float32.
    assert load_model_spec(str(path)) == replace(want, rms_norm_eps=float(np.float32(want.rms_norm_eps)))
    prompts = [[5, 17, 300, 42, 7, 99, 1, 250], list(range(40, 75))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    ours = [Engine(EngineConfig(model=str(p), num_kv_blocks=64)).generate(prompts, params) for p in (src, path)]
    assert [o.token_ids for o in ours[1]] == [o.token_ids for o in ours[0]]
    for got, want_out in zip(ours[1], ours[0]):
        np.testing.assert_allclose(got.logprobs, want_out.logprobs, rtol=0, atol=1e-5)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    via_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([prompts[1]])
    with torch.inference_mode():
        torch.testing.assert_close(via_gguf(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_linear_rope_scaling_is_read(tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    src = ckpt_dir("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    path = checkpoint_to_gguf(src, tmp_path / "linear.gguf")
    prompt = [list(range(100, 400))]  # long enough for the scaling to matter
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [Engine(EngineConfig(model=str(p), num_kv_blocks=64)).generate(prompt, params) for p in (src, path)]
    assert outs[1][0].token_ids == outs[0][0].token_ids


def test_quantized_checkpoint_weights_are_within_one_step(tmp_path: Path) -> None:
    path = checkpoint_to_gguf(TARGET, tmp_path / "target.q8_0.gguf", qtype="Q8_0")
    want = load_weights(str(TARGET), torch.float32)
    got = load_weights(str(path), torch.float32)
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: the file has no output.weight
    for name, tensor in got.items():
        step = want[name].abs().amax() / 127  # Q8_0: 32-value blocks scaled by their max / 127
        assert (tensor - want[name]).abs().max() <= step, name


def test_tokenizer_round_trips_and_matches_the_checkpoints(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = checkpoint_to_gguf(TARGET, tmp_path / "target.gguf", chat_template=CHAT_TEMPLATE)
    ours, ref = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(TARGET))
    texts = ["def fibonacci(n):\n    return n", "  two  spaces\tand\ttabs\n\n", "x = 12345 + 0.5e-3",
             "naïve café 日本語 🙂", "</s> special <s>", "import os\nprint(os.getcwd())\n" * 3, "a"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == ref.decode(ref.encode(text))
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert ours.encode("</s>", add_special_tokens=False) == [ref.eos_token_id]
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.chat_template == CHAT_TEMPLATE
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<s>user: hi</s>"


def test_spec_and_tokenizer_of_a_gguf_file_do_not_import_torch(tmp_path: Path) -> None:
    path = checkpoint_to_gguf(TARGET, tmp_path / "target.gguf")
    code = (
        "import sys; from engine.models.spec import load_model_spec, load_tokenizer, read_config;"
        f"load_model_spec({str(path)!r}); load_tokenizer({str(path)!r}).encode('x');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def _fields(reader: object) -> list[tuple]:
    return [(name, f.offset, f.types, f.data, f.contents(), [(p.dtype, p.shape, p.tobytes()) for p in f.parts])
            for name, f in reader.fields.items()]


def test_the_reader_parses_every_field_as_gguf_does(tmp_path: Path) -> None:
    """Arrays of numbers and strings parse in one pass (engine.models.gguf_reader._array_parts)
    into exactly the fields, parts and tensors gguf's own reader gives."""
    import gguf

    path = checkpoint_to_gguf(TARGET, tmp_path / "target.gguf", chat_template=CHAT_TEMPLATE)  # vocabulary, merges
    extra = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(extra), "llama")
    writer.add_array("test.floats", [1.5, -2.25, 3.0])
    writer.add_array("test.strings", ["", "é", "two words"])
    writer.add_array("test.nested", [[1, 2], [3]])  # gguf's own path (arrays of arrays)
    writer.add_token_types([1, 3, 4])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for file in (path, extra):
        ours, ref = open_gguf(str(file)).reader, gguf.GGUFReader(str(file), "r")
        assert _fields(ours) == _fields(ref)
        assert [(t.name, t.data_offset, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
            (t.name, t.data_offset, t.tensor_type, t.data.tobytes()) for t in ref.tensors]
    arrays = open_gguf(str(extra)).metadata
    assert (arrays["test.floats"], arrays["test.strings"]) == ([1.5, -2.25, 3.0], ["", "é", "two words"])
    assert arrays["test.nested"] == [1, 2, 3]  # gguf flattens nested arrays
    assert open_gguf(str(extra)).reader.fields["test.strings"].contents(1) == "é"


# -- errors -------------------------------------------------------------------------------
def test_unsupported_tensor_type_is_named_at_load(tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    path = checkpoint_to_gguf(ckpt_dir("llama"), tmp_path / "q5_0.gguf", qtype="Q5_0")
    with pytest.raises(ValueError, match=r"type Q5_0, which this loader cannot read; supported: F32, F16, BF16, Q8_0"):
        Engine(EngineConfig(model=str(path), num_kv_blocks=8))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_tensors(tmp_path / "phi.gguf", {"token_embd.weight": (np.zeros((8, 4), np.float32), "F32")}, arch="phi2")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'phi2'.*supported: llama, qwen2, qwen3"):
        load_model_spec(str(path))


def test_unsupported_pre_tokenizer_is_named(tmp_path: Path) -> None:
    path = write_vocabulary(tmp_path / "t.gguf", "llama-bpe", ["a", "b", "ab"], ["a b"])
    with pytest.raises(ValueError, match=r"pre-tokenizer 'llama-bpe'.*supported: gpt2, smollm"):
        load_tokenizer(str(path))


def test_merge_outside_the_vocabulary_is_an_error_not_a_panic(tmp_path: Path) -> None:
    path = write_vocabulary(tmp_path / "t.gguf", "gpt2", ["a", "b"], ["a b"])
    with pytest.raises(ValueError, match=r"merge 'a b' .* outside the vocabulary"):
        load_tokenizer(str(path))


def test_smollm_pre_tokenizer_isolates_digits(tmp_path: Path) -> None:
    tokens, merges = ["1", "2", "12", "Ġ", "Ġ1"], ["Ġ 1", "1 2"]
    gpt2 = load_tokenizer(str(write_vocabulary(tmp_path / "gpt2.gguf", "gpt2", tokens, merges)))
    smollm = load_tokenizer(str(write_vocabulary(tmp_path / "smollm.gguf", "smollm", tokens, merges)))
    assert gpt2.convert_ids_to_tokens(gpt2.encode(" 12")) == ["Ġ1", "2"]
    assert smollm.convert_ids_to_tokens(smollm.encode(" 12")) == ["Ġ", "1", "2"]


def test_bad_and_truncated_files_get_clear_errors(tmp_path: Path) -> None:
    good = checkpoint_to_gguf(TARGET, tmp_path / "good.gguf").read_bytes()
    cases = {"empty.gguf": b"", "magic.gguf": b"GGML" + good[4:], "header.gguf": good[:200],
             "tensors.gguf": good[: len(good) // 2]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=r"not a readable GGUF file|is truncated") as err:
            load_model_spec(str(tmp_path / name))
        assert name in str(err.value)
    with pytest.raises(ValueError, match="is not a file"):
        load_model_spec(str(tmp_path / "missing.gguf"))
