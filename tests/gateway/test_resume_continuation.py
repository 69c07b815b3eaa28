"""A resumed request at the gateway (``GenerateRequest.resume``): validation, continuation,
and the text across the cut, against the scripted decode workers of ``test_migration``.

A scripted worker refuses any prompt that is not PROMPT + SCRIPT[:num_prior_output_tokens]
and generates SCRIPT from there, so a continuation that does not prefill exactly the prompt
plus the delivered tokens (with the seeded generator told to skip their draws and the budgets
counted down) fails or yields the wrong tokens.
"""

from __future__ import annotations

import random
from dataclasses import replace

import grpc
import pytest

from gateway.server import model_limits
from gateway.text import TextStream
from gateway.validation import validate
from plumbing.config import GatewayConfig, ServerConfig
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, gateway_pb2
from tests.gateway.test_migration import MODEL, PROMPT, SCRIPT, TOKENIZER, ScriptedDecode, generate, tokens


def resumed(request: gateway_pb2.GenerateRequest, delivered: list[int], previous: int = 0) -> gateway_pb2.GenerateRequest:
    again = gateway_pb2.GenerateRequest()
    again.CopyFrom(request)
    again.resume.token_ids.extend(delivered)
    again.resume.num_previous_resumes = previous
    return again


def text_of(chunks: list[gateway_pb2.GenerateResponse]) -> str:
    return "".join(c.text for c in chunks)


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_seeded_request_continues_from_the_delivered_tokens(cut: int) -> None:
    request = make_request(PROMPT, 12, temperature=0.8, seed=7)
    request.stopping.min_new_tokens = 8
    whole, code, _ = generate([ScriptedDecode()], request)
    assert code is None and tokens(whole) == SCRIPT[:12]
    worker = ScriptedDecode()
    chunks, code, metrics = generate([worker], resumed(request, SCRIPT[:cut], previous=1))
    assert code is None
    assert tokens(chunks) == SCRIPT[cut:12]  # only what follows, each once
    assert text_of(whole[:cut]) + text_of(chunks) == text_of(whole)
    final = chunks[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.timings.resumes == 2 and final.timings.migrations == 0
    assert final.num_prompt_tokens == len(PROMPT)
    assert metrics.resumes._value.get() == 1  # noqa: SLF001 - the counter's value
    sent = worker.requests[0]
    assert list(sent.prompt_token_ids) == PROMPT + SCRIPT[:cut]
    assert sent.num_prior_output_tokens == cut  # the seeded generator skips their draws
    assert sent.stopping.max_new_tokens == 12 - cut and sent.stopping.min_new_tokens == max(0, 8 - cut)
    assert sent.sampling.seed == 7


def test_a_request_without_resume_counts_none() -> None:
    chunks, code, metrics = generate([ScriptedDecode()], make_request(PROMPT, 3))
    assert code is None and chunks[-1].timings.resumes == 0
    assert metrics.resumes._value.get() == 0  # noqa: SLF001


def test_a_resume_that_fails_before_its_first_token_is_retried_not_migrated() -> None:
    dying, survivor = ScriptedDecode(die_after=0), ScriptedDecode()
    request = make_request(PROMPT, 10)
    chunks, code, _ = generate([dying, survivor], resumed(request, SCRIPT[:4]))
    assert code is None and tokens(chunks) == SCRIPT[4:10]
    assert chunks[-1].timings.migrations == 0
    assert survivor.requests[0].num_prior_output_tokens == 4


def test_a_resume_then_a_migration_keeps_every_token_once() -> None:
    dying, survivor = ScriptedDecode(die_after=3), ScriptedDecode()
    chunks, code, _ = generate([dying, survivor], resumed(make_request(PROMPT, 12), SCRIPT[:2]))
    assert code is None and tokens(chunks) == SCRIPT[2:12]
    assert chunks[-1].timings.migrations == 1 and chunks[-1].timings.resumes == 1
    assert survivor.requests[0].num_prior_output_tokens == 5


@pytest.mark.parametrize("case", ["length", "eos", "stop_id", "stop_string"])
def test_delivered_tokens_that_end_the_request_get_only_the_final_chunk(case: str) -> None:
    request = make_request(PROMPT, 4 if case == "length" else 12,
                           stop=[TOKENIZER.decode(SCRIPT[2:4])] if case == "stop_string" else None)
    eos = (SCRIPT[3],) if case == "eos" else ()
    if case == "stop_id":
        request.stopping.stop_token_ids.append(SCRIPT[3])
    client = TextStream(TOKENIZER, PROMPT, tuple(request.stopping.stop_strings))
    before = "".join(client.add([t]) for t in SCRIPT[:4])  # what the broken stream sent
    worker = ScriptedDecode()
    chunks, code, _ = generate([worker], resumed(request, SCRIPT[:4]), eos=eos)
    assert code is None and not worker.requests
    assert len(chunks) == 1 and not chunks[0].token_ids
    want = common_pb2.FINISH_REASON_LENGTH if case == "length" else common_pb2.FINISH_REASON_STOP
    assert chunks[0].finish_reason == want
    whole = TOKENIZER.decode(SCRIPT[:2] if case == "stop_string" else SCRIPT[:4])
    assert before + chunks[0].text == whole  # held-back text, once


def test_held_back_text_comes_after_the_resume_not_twice() -> None:
    """A possible stop string holds text back; the client resumes with it still held back."""
    four = next(i for i in range(len(SCRIPT)) if TOKENIZER.decode(SCRIPT[: i + 1]).endswith("four"))
    request = make_request(PROMPT, 12, stop=["four five!"])
    whole, code, _ = generate([ScriptedDecode()], request)
    assert code is None and tokens(whole) == SCRIPT[:12]
    cut = four + 1
    before = text_of(whole[:cut])
    assert not TOKENIZER.decode(SCRIPT[:cut]).startswith(before + " ")  # some text is held back
    chunks, code, _ = generate([ScriptedDecode()], resumed(request, SCRIPT[:cut]))
    assert code is None
    assert before + text_of(chunks) == text_of(whole) == TOKENIZER.decode(SCRIPT[:12])


def _request_with(**stopping: object) -> gateway_pb2.GenerateRequest:
    request = make_request(PROMPT, 6)
    request.stopping.MergeFrom(common_pb2.StoppingCriteria(**stopping))
    return request


@pytest.mark.parametrize("delivered, stopping, eos, message", [
    (SCRIPT[:7], {}, (), r"resume\.token_ids: 7 tokens, more than stopping\.max_new_tokens=6"),
    ([SCRIPT[0], 10**6], {}, (), r"resume\.token_ids\[1\]: 1000000 is outside the vocabulary"),
    (SCRIPT[:4], {}, (SCRIPT[1],), r"resume\.token_ids\[1\]: .* is a stop token"),
    (SCRIPT[:4], {"stop_token_ids": [SCRIPT[2]]}, (), r"resume\.token_ids\[2\]: .* is a stop token"),
])
def test_impossible_resumes_are_invalid_argument_naming_the_field(
        delivered: list[int], stopping: dict, eos: tuple[int, ...], message: str) -> None:
    worker = ScriptedDecode()
    _, code, _ = generate([worker], resumed(_request_with(**stopping), delivered), eos=eos)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert not worker.requests
    limits = replace(model_limits(GatewayConfig(server=ServerConfig(), model=MODEL), TOKENIZER), eos_token_ids=eos)
    with pytest.raises(ValueError, match=message):
        validate(resumed(_request_with(**stopping), delivered), TOKENIZER, limits)


def test_stop_tokens_before_min_new_tokens_and_with_ignore_eos_may_be_followed() -> None:
    request = _request_with(min_new_tokens=3)
    chunks, code, _ = generate([ScriptedDecode()], resumed(request, SCRIPT[:3]), eos=(SCRIPT[1],))
    assert code is None and tokens(chunks) == SCRIPT[3:6]
    chunks, code, _ = generate([ScriptedDecode()], resumed(_request_with(ignore_eos=True), SCRIPT[:3]),
                               eos=(SCRIPT[1],))
    assert code is None and tokens(chunks) == SCRIPT[3:6]


def test_a_resume_with_no_tokens_is_the_request_itself() -> None:
    chunks, code, _ = generate([ScriptedDecode()], resumed(make_request(PROMPT, 5), []))
    assert code is None and tokens(chunks) == SCRIPT[:5] and chunks[-1].timings.resumes == 1


# -- text across a cut: the TextStream of the resumed gateway, against the unbroken one ------

TEXT_IDS = TOKENIZER.encode(" naïve café — «quoted» 数学 and</end> more STOP! words 😀 end",
                            add_special_tokens=False)


def _chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("stops", [(), ("</end>",), ("STOP!", "d m", "😀"), ("nd", "e")])
def test_text_after_any_cut_at_any_chunking_equals_the_unbroken_stream(stops: tuple[str, ...]) -> None:
    """The broken stream was chunked one way, the resumed one replays token by token: the
    client's text (before the cut, then after it) equals the unbroken stream's exactly."""
    rng = random.Random(5)
    for _ in range(30):
        chunks = _chunked(TEXT_IDS, rng)
        whole = TextStream(TOKENIZER, PROMPT, stops)
        pieces = [whole.add(c) for c in chunks]
        unbroken = "".join(pieces) + whole.flush()
        cut = rng.randint(0, len(chunks))
        delivered = [t for c in chunks[:cut] for t in c]
        resumed_stream = TextStream(TOKENIZER, PROMPT, stops)
        resumed_stream.add(delivered)  # what GatewayRequest.resume does
        after = "".join(resumed_stream.add(c) for c in _chunked(TEXT_IDS[len(delivered):], rng))
        assert "".join(pieces[:cut]) + after + resumed_stream.flush() == unbroken
        assert resumed_stream.stopped == whole.stopped
