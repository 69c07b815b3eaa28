"""The one prompt rule (``engine/prompt_check.py``): its table, and the places that apply it
(the gateway's validation, a worker's edge, the engine) rejecting alike, each naming its field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.prompt_check import check_prompt, check_prompt_len
from gateway.validation import Limits, validate
from plumbing.engine_service import EngineServicer
from splitserve.client import make_request

VOCAB, MAX_LEN = 10, 8

# (token ids, max_new_tokens) -> the error's text (None: accepted)
CASES = [
    ([1, 2, 3], None, None),
    ([1, 2, 3], 5, None),  # exactly what max_model_len leaves
    ([0, 9], 6, None),  # both ends of the vocabulary
    ([], None, "p must not be empty"),
    ([1] * 8, None, "p is 8 tokens; max_model_len=8 leaves no room for output"),
    ([1] * 7, None, None),  # one output token fits
    ([1, 10], None, r"p\[1\]: 10 is outside the vocabulary \[0, 10\)"),
    ([-1, 1], None, r"p\[0\]: -1 is outside the vocabulary"),
    ([1, 2.0], None, r"p\[1\]: 2\.0 is outside the vocabulary"),
    ([1, True], None, r"p\[1\]: True is outside the vocabulary"),
    ([1, 2, 3], 6, r"n=6 exceeds what max_model_len=8 leaves after a 3-token prompt \(5\)"),
]


@pytest.mark.parametrize(("ids", "max_new", "error"), CASES)
def test_the_prompt_rule(ids: list, max_new: int | None, error: str | None) -> None:
    if error is None:
        check_prompt(ids, VOCAB, MAX_LEN, "p", max_new_tokens=max_new, max_new_tokens_field="n")
    else:
        with pytest.raises(ValueError, match=f"^{error}"):
            check_prompt(ids, VOCAB, MAX_LEN, "p", max_new_tokens=max_new, max_new_tokens_field="n")


def test_the_length_alone() -> None:
    check_prompt_len(7, MAX_LEN, "p")
    with pytest.raises(ValueError, match="^p must not be empty"):
        check_prompt_len(0, MAX_LEN, "p")
    with pytest.raises(ValueError, match="^p is 8 tokens"):
        check_prompt_len(8, MAX_LEN, "p")


LIMITS = Limits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_stop_strings=1, max_stop_string_bytes=8)


@pytest.mark.parametrize(("ids", "max_new", "error"), [
    ([1, 2, 3], 5, None),
    ([1] * 8, 1, r"prompt\.token_ids is 8 tokens"),  # told before the ids are scanned
    ([1, 10], 1, r"prompt\.token_ids\[1\]: 10 is outside the vocabulary"),
    ([1, 2, 3], 6, r"stopping\.max_new_tokens=6 exceeds"),
])
def test_the_gateway_applies_the_rule_naming_its_fields(ids: list[int], max_new: int, error: str | None) -> None:
    request = make_request(ids, max_new)
    if error is None:
        assert validate(request, None, LIMITS).prompt_token_ids == ids
    else:
        with pytest.raises(ValueError, match=f"^{error}"):
            validate(request, None, LIMITS)


def _worker() -> SimpleNamespace:
    return SimpleNamespace(engine=SimpleNamespace(spec=SimpleNamespace(vocab_size=VOCAB), max_model_len=MAX_LEN))


@pytest.mark.parametrize(("ids", "num_prior", "error"), [
    ([1, 2, 3], 2, None),
    ([], 0, "prompt_token_ids must not be empty"),
    ([1, 99], 0, r"prompt_token_ids\[1\]: 99 is outside the vocabulary"),
    ([1] * 8, 0, "prompt_token_ids is 8 tokens"),
    ([1, 2, 3], 3, "num_prior_output_tokens=3 must be below the prompt's length 3"),
])
def test_a_worker_applies_the_rule_at_its_edge(ids: list[int], num_prior: int, error: str | None) -> None:
    if error is None:
        EngineServicer.check_prompt(_worker(), ids, num_prior)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=f"^{error}"):
            EngineServicer.check_prompt(_worker(), ids, num_prior)  # type: ignore[arg-type]
