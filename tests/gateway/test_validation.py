"""Gateway request validation: every rejection is a ValueError naming the field."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.validation import Limits, validate
from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, gateway_pb2

MODEL = Path(__file__).resolve().parents[2] / "models" / "target"
LIMITS = Limits(vocab_size=4096, max_model_len=512, max_stop_strings=8, max_stop_string_bytes=256)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(MODEL))


def _with_unknown_field() -> gateway_pb2.GenerateRequest:
    raw = make_request([5, 6, 7], 4).SerializeToString()
    raw += bytes([0xF8, 0x06, 0x01])  # field 111, varint 1: not in the schema
    return gateway_pb2.GenerateRequest.FromString(raw)


def _sampling(**kw: float) -> gateway_pb2.GenerateRequest:
    req = make_request([5, 6, 7], 4)
    for k, v in kw.items():
        setattr(req.sampling, k, v)
    return req


BAD = [
    ("no prompt", gateway_pb2.GenerateRequest(stopping=common_pb2.StoppingCriteria(max_new_tokens=4)), "prompt"),
    ("empty text", make_request("", 4), "prompt.text"),
    ("empty ids", gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(),
                                              stopping=common_pb2.StoppingCriteria(max_new_tokens=4)), "prompt"),
    ("id out of vocab", make_request([1, 4096], 4), "prompt.token_ids"),
    ("max_new_tokens 0", make_request([1, 2], 0), "stopping.max_new_tokens"),
    ("huge max_new_tokens", make_request([1, 2], 10**9), "stopping.max_new_tokens"),
    ("prompt too long", make_request(list(range(1, 513)), 1), "max_model_len"),
    ("negative temperature", _sampling(temperature=-0.5), "sampling.temperature"),
    ("nan temperature", _sampling(temperature=float("nan")), "temperature"),
    ("top_p 0", _sampling(top_p=0.0), "sampling.top_p"),
    ("top_p above 1", _sampling(top_p=1.5), "sampling.top_p"),
    ("logprobs above 20", _sampling(logprobs=21), "sampling.logprobs"),
    ("too many stop strings", make_request([1, 2], 4, stop=[f"s{i}" for i in range(9)]), "stopping.stop_strings"),
    ("stop string too long", make_request([1, 2], 4, stop=["x" * 257]), "stopping.stop_strings"),
    ("empty stop string", make_request([1, 2], 4, stop=[""]), "stopping.stop_strings"),
    ("unknown field", _with_unknown_field(), "unknown field"),
]


@pytest.mark.parametrize("request_, field", [(r, f) for _, r, f in BAD], ids=[n for n, _, _ in BAD])
def test_bad_requests_name_the_field(tokenizer, request_: gateway_pb2.GenerateRequest, field: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate(request_, tokenizer, LIMITS)


def test_min_new_tokens_above_max_is_rejected(tokenizer) -> None:  # noqa: ANN001
    req = make_request([1, 2], 4)
    req.stopping.min_new_tokens = 5
    with pytest.raises(ValueError, match=r"stopping\.min_new_tokens"):
        validate(req, tokenizer, LIMITS)


def test_a_good_request_yields_prompt_ids_params_and_stops(tokenizer) -> None:  # noqa: ANN001
    req = make_request("def f(x):", 7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["\n\n"])
    out = validate(req, tokenizer, LIMITS)
    assert out.prompt_token_ids == list(tokenizer.encode("def f(x):"))
    assert out.params.max_tokens == 7 and out.params.temperature == 0.5 and out.params.top_k == 5
    assert out.params.seed == 3 and abs(out.params.top_p - 0.9) < 1e-6
    assert out.stop_strings == ("\n\n",)
    # Largest allowed output: exactly what max_model_len leaves.
    long_ok = make_request([1] * 500, 12)
    assert validate(long_ok, tokenizer, LIMITS).params.max_tokens == 12


def test_forwarded_params_are_the_validated_ones() -> None:
    """The gateway forwards the canonical protos of what it validated; a worker converting
    them gets exactly the validated SamplingParams."""
    from plumbing.convert import sampling_params_from_proto
    from splitserve_api.v1 import common_pb2

    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                                           repetition_penalty=1.1, seed=5, logprobs=2,
                                           num_speculative_tokens=0),
        stopping=common_pb2.StoppingCriteria(max_new_tokens=9, min_new_tokens=2, stop_token_ids=[7],
                                             stop_strings=["\n\n"]),
    )
    validated = validate(request, None, LIMITS)
    assert sampling_params_from_proto(validated.sampling, validated.stopping) == validated.params
    assert validated.params.seed == 5 and validated.params.num_speculative_tokens == 0
    assert list(validated.stopping.stop_strings) == []  # stop strings stay at the gateway
    plain = validate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[1]), stopping=common_pb2.StoppingCriteria(max_new_tokens=3)),
        None, LIMITS)
    assert sampling_params_from_proto(plain.sampling, plain.stopping) == plain.params
