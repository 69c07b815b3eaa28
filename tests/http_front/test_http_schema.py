"""The HTTP front's request checks and error mapping (no processes)."""

from __future__ import annotations

import grpc
import pytest

from http_front.errors import ApiError, from_rpc, param_of
from http_front.schema import parse
from splitserve_api.v1 import gateway_pb2


def test_a_completion_body_becomes_one_generate_request() -> None:
    parsed = parse({"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                    "stop": "\n", "logprobs": 2, "user": "ignored"}, chat=False, default_max_tokens=99)
    [request] = parsed.requests
    assert request.text == "hi" and request.stopping.max_new_tokens == 7
    assert list(request.stopping.stop_strings) == ["\n"]
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.0, 0.5, 3)
    assert request.sampling.logprobs == 2 and parsed.logprobs == 2 and not parsed.stream


def test_token_prompts_chat_defaults_and_n_choices() -> None:
    [request] = parse({"model": "m", "prompt": [[1, 2, 3]]}, chat=False, default_max_tokens=9).requests
    assert list(request.token_ids.ids) == [1, 2, 3] and request.stopping.max_new_tokens == 9
    parsed = parse({"model": "m", "messages": [{"role": "system", "content": "s"},
                                               {"role": "user", "content": [{"type": "text", "text": "u"}]}],
                    "n": 3, "seed": 10, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 4,
                    "stream": True, "stream_options": {"include_usage": True}}, chat=True, default_max_tokens=9)
    assert [m.content for m in parsed.requests[0].chat.messages] == ["s", "u"]
    assert parsed.requests[0].chat.messages[0].role == gateway_pb2.CHAT_ROLE_SYSTEM
    assert [r.sampling.seed for r in parsed.requests] == [10, 11, 12]  # each choice its own draws
    assert parsed.requests[2].stopping.max_new_tokens == 5 and parsed.logprobs == 4
    assert parsed.stream and parsed.include_usage


BAD = [
    ([], "body"),
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt[1]"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop[0]"),
    ({"model": "m", "prompt": "x", "n": 9}, "n"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_each_bad_field_is_named(body: object, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, chat=False, default_max_tokens=16)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_each_bad_chat_field_is_named(body: object, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, chat=True, default_max_tokens=16)
    assert caught.value.param == param


def test_gateway_statuses_map_to_http_and_the_proto_field_to_the_parameter() -> None:
    error = from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_new_tokens=900 exceeds what max_model_len=512 leaves")
    assert (error.status, error.param, error.type) == (400, "max_tokens", "invalid_request_error")
    assert param_of("sampling.temperature must be >= 0") == "temperature"
    assert param_of("prompt.chat: this model has no chat template") == "messages"
    assert param_of("something else") is None
    assert [from_rpc(code, "").status for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                    grpc.StatusCode.INTERNAL)] == [401, 429, 503, 504, 500]
    assert from_rpc(grpc.StatusCode.UNAVAILABLE, "no live decode worker").param is None


def test_request_ids_are_checked_for_length_and_charset() -> None:
    from plumbing.rpc import check_request_id

    assert check_request_id(None) is None
    assert check_request_id("3f2a-9b.c_d:1") == "3f2a-9b.c_d:1"
    assert check_request_id("a" * 128) == "a" * 128
    for bad in ("", "a" * 129, "has space", "new\nline", '{"json": 1}', "caf\u00e9"):
        with pytest.raises(ValueError, match="x-request-id"):
            check_request_id(bad)


def test_the_first_error_in_field_group_order_is_reported() -> None:
    with pytest.raises(ApiError) as caught:  # model (first group) before prompt before max_tokens
        parse({"model": 3, "prompt": 3, "max_tokens": "x"}, chat=False, default_max_tokens=16)
    assert caught.value.param == "model"
    with pytest.raises(ApiError) as caught:
        parse({"model": "m", "prompt": 3, "max_tokens": "x"}, chat=False, default_max_tokens=16)
    assert caught.value.param == "prompt" and "string or a list of token ids" in caught.value.message


def test_error_locations_become_parameter_paths() -> None:
    from http_front.errors import param_path

    assert param_path(("messages", 0, "content", "<list>", 2, "text")) == "messages[0].content[2].text"
    assert param_path(("prompt", "<list>", 3)) == "prompt[3]"
    assert param_path(("stream_options", "include_usage")) == "stream_options.include_usage"
    assert param_path(()) == "body"


def test_unserved_fields_are_refused_only_when_set() -> None:
    parsed = parse({"model": "m", "prompt": "x", "echo": False, "tools": [], "logit_bias": {}, "best_of": None},
                   chat=False, default_max_tokens=16)
    assert parsed.requests[0].text == "x"
    for name in ("tools", "response_format", "logit_bias"):
        with pytest.raises(ApiError) as caught:
            parse({"model": "m", "prompt": "x", name: {"x": 1}}, chat=False, default_max_tokens=16)
        assert caught.value.param == name


def test_a_field_group_is_added_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """What structured output does (docs/architecture.md, "Adding a field group"): a group
    with its fields and ``apply``, added to the endpoint's tuple."""
    from typing import Annotated

    from pydantic import Field

    from http_front import schema

    class Tagged(schema.FieldGroup):
        tag: schema.Text | None = None
        weight: Annotated[int, Field(ge=0, le=schema.UINT32_MAX)] | None = None

        def apply(self, request: gateway_pb2.GenerateRequest) -> None:
            if self.weight is not None:
                request.sampling.top_k = self.weight

    groups = (*schema.COMPLETION_GROUPS, Tagged)
    monkeypatch.setattr(schema, "COMPLETION_GROUPS", groups)
    monkeypatch.setattr(schema, "CompletionBody", schema.body_model(groups, "CompletionBody"))
    parsed = parse({"model": "m", "prompt": "x", "tag": "t", "weight": 7}, chat=False, default_max_tokens=4)
    assert parsed.requests[0].sampling.top_k == 7 and parsed.body.tag == "t"
    for bad, param in (({"weight": 2**32}, "weight"), ({"tag": "\ud800"}, "tag"), ({"tag": 1}, "tag")):
        with pytest.raises(ApiError) as caught:
            parse({"model": "m", "prompt": "x", **bad}, chat=False, default_max_tokens=4)
        assert caught.value.param == param
