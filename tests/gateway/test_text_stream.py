"""Gateway-side incremental text with stop strings."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.text import TextStream

MODEL = Path(__file__).resolve().parents[2] / "models" / "target"


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(MODEL))


def _feed(stream: TextStream, ids: list[int], chunk: int) -> str:
    out = ""
    for i in range(0, len(ids), chunk):
        out += stream.add(ids[i : i + chunk])
        if stream.stopped:
            return out
    return out + stream.flush()


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_without_stop_strings_text_is_the_decoded_tokens(tokenizer, chunk: int) -> None:  # noqa: ANN001
    prompt = tokenizer.encode("def f(x, add_special_tokens=False):\n")
    ids = tokenizer.encode("    return x + 1  # ünïcode ✓\n", add_special_tokens=False)
    text = _feed(TextStream(tokenizer, prompt, ()), ids, chunk)
    assert text == "    return x + 1  # ünïcode ✓\n"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_cuts_the_text_at_its_start(tokenizer, chunk: int) -> None:  # noqa: ANN001
    ids = tokenizer.encode("x = 1\nreturn x\ny = 2\n", add_special_tokens=False)
    stream = TextStream(tokenizer, [1], ("return",))
    text = _feed(stream, ids, chunk)
    assert stream.stopped
    assert text == "x = 1\n"


def test_text_that_might_start_a_stop_string_is_held_back_until_decided(tokenizer) -> None:  # noqa: ANN001
    stream = TextStream(tokenizer, [1], ("STOP!",))
    first = stream.add(tokenizer.encode("abc ST", add_special_tokens=False))
    assert first == "ab"  # 'c ST' could still become 'STOP!' (hold back len-1 = 4 chars)
    rest = stream.add(tokenizer.encode("ART", add_special_tokens=False))
    assert not stream.stopped
    assert first + rest + stream.flush() == "abc START"


def test_stop_string_spanning_chunks_is_found(tokenizer) -> None:  # noqa: ANN001
    stream = TextStream(tokenizer, [1], ("</end>",))
    out = stream.add(tokenizer.encode("value </e", add_special_tokens=False))
    out += stream.add(tokenizer.encode("nd> tail", add_special_tokens=False))
    assert stream.stopped
    assert out == "value "
