"""The OpenAI front's structured-output parameters -> Constraint, and replies -> tool calls."""

from __future__ import annotations

import asyncio
import json

import pytest

from http_front import structured
from http_front.errors import ApiError
from http_front.schema import parse
from splitserve_api.v1 import common_pb2

C = common_pb2.Constraint
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
PLAN = structured.ToolPlan(("f",), True)


@pytest.mark.parametrize("extra,want", [
    ({"response_format": {"type": "json_object"}}, C(json_object=C.JsonObject())),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"},
                                                                 "strict": True}}},
     C(json_schema=C.JsonSchema(schema='{"type": "object"}', strict=True))),
    ({"response_format": {"type": "text"}}, C()),
    ({"guided_regex": "[0-9]+"}, C(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, C(choice=C.Choice(choices=["a", "b"]))),
    ({"guided_grammar": 'start: "x"'}, C(grammar='start: "x"')),
    ({"guided_json": {"type": "array"}}, C(json_schema=C.JsonSchema(schema='{"type": "array"}'))),
])
def test_constraint_parameters(extra: dict, want: common_pb2.Constraint) -> None:
    for chat, base in ((True, CHAT), (False, {"model": "m", "prompt": "p"})):
        assert parse({**base, **extra}, chat, 16).requests[0].constraint == want


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 3}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_parameters_are_named(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse({**CHAT, **extra}, True, 16)
    assert caught.value.status == 400 and caught.value.param == param


def test_tools_on_completions_are_refused() -> None:
    with pytest.raises(ApiError, match="tools"):
        parse({"model": "m", "prompt": "p", "tools": [TOOL]}, False, 16)


def test_required_tools_constrain_with_a_call_grammar_and_describe_the_tools() -> None:
    parsed = parse({**CHAT, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, True, 16)
    request = parsed.requests[0]
    assert parsed.tools == PLAN
    grammar = request.constraint.grammar
    assert grammar.startswith('start: call\ncall: "<tool_call>" body "</tool_call>"\nbody: %json ')
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert schema["anyOf"][0]["properties"]["name"] == {"const": "f"}
    assert request.chat.messages[0].content.startswith("You may call one or more functions")
    assert '"name": "f"' in request.chat.messages[0].content and request.chat.messages[1].content == "hi"


def test_auto_is_unconstrained_and_none_ignores_tools() -> None:
    auto = parse({**CHAT, "tools": [TOOL]}, True, 16)
    assert auto.tools == structured.ToolPlan(("f",), False) and not auto.requests[0].HasField("constraint")
    none = parse({**CHAT, "tools": [TOOL], "tool_choice": "none"}, True, 16)
    assert none.tools is None and len(none.requests[0].chat.messages) == 1


def test_tool_turns_in_the_history_become_template_roles() -> None:
    messages = [{"role": "user", "content": "x?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "42"}]
    request = parse({"model": "m", "messages": messages, "tools": [TOOL]}, True, 16).requests[0]
    contents = [m.content for m in request.chat.messages]
    assert contents[2] == '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert contents[3] == "<tool_response>\n42\n</tool_response>"


def test_reply_text_becomes_tool_calls() -> None:
    body = {"choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content":
            'ok <tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'}},
        {"index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "<tool_call>{"}},
        {"index": 2, "finish_reason": "stop", "message": {"role": "assistant", "content":
            '<tool_call>{"name": "other", "arguments": {}}</tool_call>'}}]}
    out = structured.attach_tool_calls(body, PLAN)["choices"]
    assert out[0]["finish_reason"] == "tool_calls" and out[0]["message"]["content"] == "ok"
    assert out[0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 2}'}
    assert out[1]["finish_reason"] == "length" and "tool_calls" not in out[1]["message"]
    assert out[2]["finish_reason"] == "stop"  # not a listed function: left as content


def test_stream_holds_content_and_sends_tool_call_deltas() -> None:
    def event(delta: dict, finish: str | None = None) -> dict:
        return {"id": "x", "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "delta": delta}]}

    async def source():  # noqa: ANN202
        for e in (event({"role": "assistant", "content": "<tool_call>"}),
                  event({"content": '{"name": "f", "arguments": {"x": 3}}'}),
                  event({"content": "</tool_call>"}, "stop"), {"id": "x", "choices": [], "usage": {}}):
            yield e

    async def collect() -> list[dict]:
        return [e async for e in structured.tool_call_events(source(), PLAN)]

    events = asyncio.run(collect())
    deltas = [e["choices"][0]["delta"] if e["choices"] else None for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    call = deltas[1]["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"x": 3}'}
    assert events[2]["choices"][0]["finish_reason"] == "tool_calls" and deltas[3] is None
