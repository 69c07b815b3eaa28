"""OpenAI request bodies -> the gateway's ``GenerateRequest``, checked field by field.

Only the shape is checked here (types, ranges the protobuf cannot carry, fields we do not
serve); the values are the gateway's to judge (``gateway/validation.py``), so a rule lives
in one place and the gateway's message, naming the proto field, comes back as a 400 naming
the OpenAI parameter (``http_front/errors.py``). Fields OpenAI clients send that change
nothing here (``user``, ``metadata``...) are ignored, as vLLM and TGI do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from http_front import structured
from http_front.errors import bad_field
from splitserve.v1 import common_pb2, gateway_pb2

MAX_N = 8  # choices per request (each is its own gateway request)
MAX_LOGPROBS = 20  # the gateway's cap on top alternatives
_ROLES = {"system": gateway_pb2.CHAT_ROLE_SYSTEM, "user": gateway_pb2.CHAT_ROLE_USER,
          "assistant": gateway_pb2.CHAT_ROLE_ASSISTANT, "developer": gateway_pb2.CHAT_ROLE_SYSTEM}
_UNSERVED = ("echo", "best_of", "suffix", "functions", "logit_bias")  # tools, response_format: structured.py


@dataclass(frozen=True)
class Parsed:
    """A request as the front will run it: ``n`` gateway requests (``requests[i]`` is choice
    i), whether to stream, and how to report logprobs."""

    chat: bool
    model: str
    requests: tuple[gateway_pb2.GenerateRequest, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: none asked; else the number of top alternatives
    tools: structured.ToolPlan | None = None  # chat with tools: how replies become tool calls


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        raise bad_field(name, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(name, f"must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise bad_field(name, f"must be in [{low}, {high}], got {value}")
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise bad_field("stop", "must be a string or a list of strings")


def _prompt(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad_field("prompt", "token ids must be >= 0")
        request.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_field("prompt", "one prompt per request (send a batch as separate requests)")
    else:
        raise bad_field("prompt", "must be a string or a list of token ids")


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_field(f"messages[{i}].content", "must be a string or a list of text parts")


def _messages(body: dict[str, Any], request: gateway_pb2.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise bad_field(f"messages[{i}].role", f"must be one of {sorted(_ROLES)}")
        request.chat.messages.add(role=_ROLES[message["role"]], content=_content(message, i))


def _sampling(body: dict[str, Any]) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                            ("repetition_penalty", 0.0, 10.0)):
        value = _number(body, name, low, high)
        if value is not None:
            setattr(sampling, name, value)
    top_k = _int(body, "top_k", -1)
    sampling.top_k = max(top_k or 0, 0)
    seed = _int(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0):
            raise bad_field(name, "is not supported (use repetition_penalty)")
    return sampling


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse(body: object, chat: bool, default_max_tokens: int) -> Parsed:
    """Check an OpenAI completions (``chat`` False) or chat completions body; raise
    ``ApiError`` (400 naming the field) when it cannot be served."""
    if not isinstance(body, dict):
        raise bad_field("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", "must be a non-empty string")
    for name in _UNSERVED:
        if body.get(name) not in (None, False, [], {}):
            raise bad_field(name, "is not supported by this server")
    body, extra = structured.parse(body, chat)
    request = gateway_pb2.GenerateRequest(sampling=_sampling(body), constraint=extra.constraint)
    (_messages if chat else _prompt)(body, request)
    limit = (_int(body, "max_completion_tokens", 1) if chat else None) or _int(body, "max_tokens", 1)
    request.stopping.max_new_tokens = limit or default_max_tokens
    request.stopping.min_new_tokens = _int(body, "min_tokens", 0) or 0
    request.stopping.stop_strings.extend(_stop(body))
    request.stopping.ignore_eos = _bool(body, "ignore_eos")
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    n = _int(body, "n", 1, MAX_N) or 1
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_field("stream_options", "must be an object")
    return Parsed(chat=chat, model=model, requests=tuple(_choice(request, i) for i in range(n)),
                  stream=_bool(body, "stream"), include_usage=bool((options or {}).get("include_usage")),
                  logprobs=logprobs, tools=extra.tools)


def _choice(request: gateway_pb2.GenerateRequest, index: int) -> gateway_pb2.GenerateRequest:
    """Choice ``index``'s request: a seeded request's choices draw from seeds seed, seed + 1...
    so they differ (and each is reproducible)."""
    if index == 0:
        return request
    copy = gateway_pb2.GenerateRequest()
    copy.CopyFrom(request)
    if copy.sampling.HasField("seed"):
        copy.sampling.seed = (copy.sampling.seed + index) % 2**64
    return copy
