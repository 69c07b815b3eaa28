"""Structured output and tool calling on the OpenAI API -> the gateway's ``Constraint``.

Parameters (at most one constraint source per request):

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* vLLM's extensions, named as vLLM names them: ``guided_json`` (a schema, object or text),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (llguidance's
  Lark dialect);
* chat only: ``tools`` (``{"type": "function", "function": {"name", "description",
  "parameters"}}``), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
  ``{"type": "function", "function": {"name"}}``), ``parallel_tool_calls``.

Tool calls use the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` style (Hermes,
Qwen, SmolLM2's tool-use data): the tools are described in the system message, and the
reply's ``<tool_call>`` blocks become ``message.tool_calls``. With ``required`` or a named
function the reply is constrained by a grammar (one call, or up to ``MAX_PARALLEL_CALLS``
with ``parallel_tool_calls``), so every call names a given function and its arguments
validate against its ``parameters``; with ``auto`` the model chooses and the reply is parsed.
A reply cut by ``max_tokens`` keeps ``finish_reason: "length"`` and carries no tool calls.
Only shapes are checked here; the gateway compiles the constraint and reports what fails.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from http_front.errors import bad_field
from splitserve_api.v1 import common_pb2

MAX_PARALLEL_CALLS = 4
MAX_TOOLS = 64
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
C = common_pb2.Constraint


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's reply turns into tool calls (None on ``Parsed``: no tools)."""

    names: tuple[str, ...]
    constrained: bool  # required / named: the grammar guarantees the calls


@dataclass
class Structured:
    """What ``parse`` found: the constraint to send, the tools plan, the system text to add."""

    constraint: common_pb2.Constraint | None = None
    tools: ToolPlan | None = None
    system_text: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)


def _schema_text(value: object, param: str) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str) and value:
        return value
    raise bad_field(param, "must be a JSON schema (an object)")


def _response_format(value: object) -> common_pb2.Constraint | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_field("response_format", 'type must be "text", "json_object" or "json_schema"')
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return C(json_object=C.JsonObject())
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_field("response_format.json_schema", "must be an object with a schema")
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise bad_field("response_format.json_schema.strict", "must be a boolean")
    return C(json_schema=C.JsonSchema(schema=_schema_text(spec["schema"], "response_format.json_schema.schema"),
                                      strict=strict))


def _guided(name: str, value: object) -> common_pb2.Constraint:
    if name == "guided_json":
        return C(json_schema=C.JsonSchema(schema=_schema_text(value, name)))
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
            raise bad_field(name, "must be a non-empty list of strings")
        return C(choice=C.Choice(choices=value))
    if not isinstance(value, str) or not value:
        raise bad_field(name, "must be a non-empty string")
    return C(regex=value) if name == "guided_regex" else C(grammar=value)


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise bad_field("tools", f"must be a list of 1..{MAX_TOOLS} tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_field(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ...}}')
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise bad_field(f"tools[{i}].function.parameters", "must be a JSON schema (an object)")
        functions.append({"name": function["name"], "description": function.get("description", ""),
                          "parameters": parameters})
    return functions


def _tool_choice(body: dict[str, Any], names: list[str]) -> str | None:
    """"none", "auto", "required", or the named function (validated)."""
    choice = body.get("tool_choice", "auto")
    if choice in ("none", "auto", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or function.get("name") not in names:
        raise bad_field("tool_choice", f'must be "none", "auto", "required" or a function among {names}')
    return None if function is None else str(function["name"])


def _call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one or more ``<tool_call>`` blocks."""
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                        for f in functions],
              "x-guidance": {"whitespace_flexible": False}}
    more = ' ("\\n" call)?' * (MAX_PARALLEL_CALLS - 1) if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {json.dumps(schema)}'


def _tool_prompt(functions: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return ("You may call one or more functions to assist with the user query. The functions you can "
            f"call:\n<tools>\n{listed}\n</tools>\nFor each function call, return a JSON object with the "
            "function name and arguments within <tool_call></tool_call> tags:\n"
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')


def _tool_messages(messages: object) -> object:
    """Earlier tool turns as the template's roles: an assistant's ``tool_calls`` as its
    ``<tool_call>`` text, a ``tool`` message as a user turn in ``<tool_response>`` tags."""
    if not isinstance(messages, list):
        return messages
    converted = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
        elif isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [c.get("function", {}) for c in message["tool_calls"] if isinstance(c, dict)]
            text = "\n".join(f'<tool_call>{{"name": {json.dumps(c.get("name"))}, "arguments": {c.get("arguments", "{}")}}}'
                             "</tool_call>" for c in calls)
            message = {"role": "assistant", "content": (message.get("content") or "") + text}
        converted.append(message)
    return converted


def _strip(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items()
            if k not in ("tools", "tool_choice", "parallel_tool_calls", "response_format", *_GUIDED)}


def parse(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], Structured]:
    """The body as the rest of the parser should see it (these parameters removed, earlier
    tool turns rewritten, the tools' system text added) and what to add to the request."""
    if not chat and body.get("tools") not in (None, []):
        raise bad_field("tools", "is served on /v1/chat/completions only")
    sources = [name for name in ("response_format", *_GUIDED) if body.get(name) is not None]
    use_tools = chat and body.get("tools") not in (None, []) and body.get("tool_choice") != "none"
    if len(sources) + use_tools > 1:
        raise bad_field(sources[-1], f"only one of response_format, {', '.join(_GUIDED)} and tools may be set")
    found = Structured()
    if sources:
        value = body[sources[0]]
        found.constraint = _response_format(value) if sources[0] == "response_format" else _guided(sources[0], value)
    stripped = _strip(body)
    if chat and body.get("tools") not in (None, []):  # a conversation with tool turns
        stripped["messages"] = _tool_messages(body.get("messages"))
    if use_tools:
        _plan_tools(body, found)
        stripped["messages"] = _with_system_text(stripped["messages"], found.system_text)
    return stripped, found


def _plan_tools(body: dict[str, Any], found: Structured) -> None:
    functions = _tools(body)
    names = [f["name"] for f in functions]
    choice = _tool_choice(body, names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_field("parallel_tool_calls", "must be a boolean")
    if choice not in ("auto", "required"):  # a named function
        functions = [f for f in functions if f["name"] == choice]
    found.system_text = _tool_prompt(functions)
    constrained = choice != "auto"
    if constrained:
        found.constraint = C(grammar=_call_grammar(functions, parallel))
    found.tools = ToolPlan(tuple(f["name"] for f in functions), constrained)


def _with_system_text(messages: object, text: str) -> object:
    if not isinstance(messages, list) or not messages:
        return messages  # the message checks report it
    first = messages[0]
    if isinstance(first, dict) and first.get("role") in ("system", "developer") and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- replies ------------------------------------------------------------------------------
def tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's content outside ``<tool_call>`` blocks (None when empty) and its calls in
    the OpenAI shape. A block that is not a JSON call of a listed function stays content."""
    calls, kept, last = [], [], 0
    for match in _CALL_RE.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or call.get("name") not in plan.names:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def attach_tool_calls(body: dict[str, Any], plan: ToolPlan | None) -> dict[str, Any]:
    """A whole chat response with each choice that ended ``stop`` on tool calls rewritten:
    ``message.tool_calls`` and ``finish_reason: "tool_calls"``."""
    if plan is None:
        return body
    for choice in body["choices"]:
        if choice["finish_reason"] != "stop":
            continue
        content, calls = tool_calls(choice["message"]["content"], plan)
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
    return body


async def tool_call_events(events: AsyncIterator[dict[str, Any]], plan: ToolPlan | None) -> AsyncIterator[dict[str, Any]]:
    """A chat stream with tools: each choice's content is held back until it finishes, then
    sent as ``tool_calls`` deltas (one per call, arguments whole) and ``finish_reason:
    "tool_calls"``, or, without calls, as one content delta. Other events pass through."""
    if plan is None:
        async for event in events:
            yield event
        return
    held: dict[int, str] = {}
    async for event in events:
        if not event.get("choices"):
            yield event
            continue
        item = event["choices"][0]
        delta = item.get("delta", {})
        held[item["index"]] = held.get(item["index"], "") + (delta.get("content") or "")
        if item.get("finish_reason") is None:
            if "role" in delta:
                yield {**event, "choices": [{**item, "delta": {"role": "assistant", "content": ""}}]}
            continue
        for update in _final_deltas(held.pop(item["index"]), item, plan):
            yield {**event, "choices": [update]}


def _final_deltas(text: str, item: dict[str, Any], plan: ToolPlan) -> list[dict[str, Any]]:
    content, calls = tool_calls(text, plan) if item["finish_reason"] == "stop" else (text, [])
    base = {"index": item["index"], "logprobs": None, "finish_reason": None}
    if not calls:
        return [{**base, "delta": {"content": text}}, {**item, "delta": {}}]
    deltas = [{**base, "delta": {"content": content}}] if content else []
    deltas += [{**base, "delta": {"tool_calls": [{"index": i, **call}]}} for i, call in enumerate(calls)]
    return deltas + [{**item, "delta": {}, "finish_reason": "tool_calls"}]
