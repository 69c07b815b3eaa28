"""The one stop rule (``engine/stopping.py``), its table, and both its users: the scheduler and
the gateway (tokens already sent, a resume) decide every case alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.sampling_params import SamplingParams
from engine.stopping import LENGTH, STOP, finish_reason
from gateway.request import GatewayRequest
from gateway.validation import Limits
from splitserve_api.v1 import common_pb2

EOS = (2,)
MAX_MODEL_LEN = 64

# (params, last token, outputs so far, tokens in all) -> reason
CASES = [
    (dict(max_tokens=8), 5, 1, 11, None),
    (dict(max_tokens=8), 2, 1, 11, STOP),  # EOS
    (dict(max_tokens=8, ignore_eos=True), 2, 1, 11, None),
    (dict(max_tokens=8, stop_token_ids=(9,)), 9, 3, 13, STOP),
    (dict(max_tokens=8, stop_token_ids=(9,), ignore_eos=True), 9, 3, 13, STOP),  # ignore_eos spares EOS only
    (dict(max_tokens=8, min_tokens=3), 2, 2, 12, None),  # EOS before min_tokens: goes on
    (dict(max_tokens=8, min_tokens=3, stop_token_ids=(9,)), 9, 2, 12, None),
    (dict(max_tokens=8, min_tokens=3), 2, 3, 13, STOP),  # at min_tokens it counts
    (dict(max_tokens=8), 5, 8, 18, LENGTH),
    (dict(max_tokens=8), 2, 8, 18, STOP),  # a stop token wins over the length
    (dict(max_tokens=8, min_tokens=8, ignore_eos=True), 2, 8, 18, LENGTH),
    (dict(max_tokens=100), 5, 4, MAX_MODEL_LEN, LENGTH),  # max_model_len tokens in all
    (dict(max_tokens=100), 5, 4, MAX_MODEL_LEN - 1, None),
]


@pytest.mark.parametrize(("params", "last", "num_out", "num_tokens", "want"), CASES)
def test_the_stop_rule(params: dict, last: int, num_out: int, num_tokens: int, want: str | None) -> None:
    assert finish_reason(SamplingParams(**params), last, num_out, num_tokens, MAX_MODEL_LEN, EOS) == want


_PROTO = {None: None, STOP: common_pb2.FINISH_REASON_STOP, LENGTH: common_pb2.FINISH_REASON_LENGTH}


@pytest.mark.parametrize(("params", "last", "num_out", "num_tokens", "want"), CASES)
def test_the_gateway_decides_tokens_already_sent_by_the_same_rule(params: dict, last: int, num_out: int,
                                                                    num_tokens: int, want: str | None) -> None:
    prompt = [7] * (num_tokens - num_out)
    validated = SimpleNamespace(params=SamplingParams(**params), prompt_token_ids=prompt)
    req = GatewayRequest(1, validated, None, (), lambda: None, None)  # type: ignore[arg-type]
    req.token_ids = [5] * (num_out - 1) + [last]
    limits = Limits(vocab_size=100, max_model_len=MAX_MODEL_LEN, max_stop_strings=1, max_stop_string_bytes=1,
                    eos_token_ids=EOS)
    assert req.finished_by_sent(limits) == _PROTO[want]


def test_the_scheduler_uses_the_rule() -> None:
    from engine import scheduler

    assert scheduler.finish_reason is finish_reason
