"""OpenAI request bodies -> the gateway's ``GenerateRequest``, checked field by field.

One schema layer: a body is a pydantic model in strict mode (no coercion: ``"y"`` is not a
boolean, ``2.0`` not an integer), composed of **field groups**. A group declares its fields
with their types and ranges, the proto's (``uint32`` max_tokens, min_tokens, top_k and token
ids; ``uint64`` seed) or OpenAI's where narrower, and ``apply`` writes them into the gateway
request. Every string the request carries is ``Text``: valid UTF-8, so a lone surrogate is a
400 naming its field, not an encoding error. The first thing wrong is a 400 naming the field
(``errors.from_validation``: ``messages[0].content``). Fields OpenAI clients send that change
nothing here (``user``, ``metadata``...) are ignored, as vLLM and TGI do.

Only the shape is checked here; the values are the gateway's to judge (``gateway/validation.py``:
a prompt past the context, too many stop strings), so a rule lives in one place and the
gateway's message, naming the proto field, comes back as a 400 naming the OpenAI parameter
(``http_front/errors.py``).

Adding a field group (docs/architecture.md, "One request"): a ``FieldGroup`` subclass with the
fields and an ``apply``, added to ``COMPLETION_GROUPS`` and/or ``CHAT_GROUPS`` (and its fields
taken out of ``UNSERVED``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationError, ValidationInfo, create_model, field_validator)
from pydantic_core import PydanticCustomError

from http_front import structured
from http_front.errors import bad_field, from_validation
from splitserve_api.v1 import gateway_pb2

MAX_N = 8  # choices per request (each is its own gateway request)
MAX_LOGPROBS = 20  # the gateway's cap on top alternatives
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
_ROLES = {"system": gateway_pb2.CHAT_ROLE_SYSTEM, "user": gateway_pb2.CHAT_ROLE_USER,
          "assistant": gateway_pb2.CHAT_ROLE_ASSISTANT, "developer": gateway_pb2.CHAT_ROLE_SYSTEM}
# Refused when set to anything but null/false/[]/{}: what this server does not do.
# (tools, tool_choice, parallel_tool_calls, response_format and guided_*: http_front/structured.py)
UNSERVED = ("echo", "best_of", "suffix", "functions", "logit_bias")


def _utf8(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError("utf8", "holds a lone surrogate (U+{code}) at character {at}: not valid "
                                      "UTF-8 text", {"code": f"{ord(value[exc.start]):04X}", "at": exc.start}) from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
Uint32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]


def _number(low: float, high: float) -> Any:
    return Annotated[float, Field(ge=low, le=high, allow_inf_nan=False)] | None


def _kind(value: object) -> str | None:
    """The union tag of a prompt or content: ``"<text>"`` or ``"<list>"`` (``errors.param_path``
    drops tags, which start with ``<``)."""
    return "<text>" if isinstance(value, str) else "<list>" if isinstance(value, list) else None


def _one_prompt(value: object) -> object:
    """A batch of one (``["text"]``, ``[[1, 2]]``) is that prompt; a larger batch is refused."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise PydanticCustomError("batch", "one prompt per request (send a batch as separate requests)")
        return value[0]
    return value


def _either(text: Any, items: Any, message: str) -> Any:
    return Annotated[Annotated[text, Tag("<text>")] | Annotated[items, Tag("<list>")],
                     Discriminator(_kind, custom_error_type="kind", custom_error_message=message)]


Prompt = Annotated[_either(Text, Annotated[list[Uint32], Field(min_length=1)], "must be a string or a list of token ids"),
                   BeforeValidator(_one_prompt)]


class Strict(BaseModel):
    """A JSON object of a body: strict (no coercion); fields not declared are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class FieldGroup(Strict):
    """Some top-level fields of a body and what they set on the gateway request."""

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        """Write this group's fields into ``request``."""


class ModelField(FieldGroup):
    model: Annotated[str, Field(min_length=1), AfterValidator(_utf8)]


class CompletionPrompt(FieldGroup):
    prompt: Prompt

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


Content = _either(Text, list[TextPart], "must be a string or a list of text parts")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Content


class ChatMessages(FieldGroup):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            request.chat.messages.add(role=_ROLES[m.role], content=content)


class Sampling(FieldGroup):
    temperature: _number(0.0, 2.0) = None
    top_p: _number(0.0, 1.0) = None
    min_p: _number(0.0, 1.0) = None
    repetition_penalty: _number(0.0, 10.0) = None
    top_k: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None  # -1 (or 0): off
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    presence_penalty: _number(-2.0, 2.0) = None
    frequency_penalty: _number(-2.0, 2.0) = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _unserved_penalty(cls, value: float | None) -> float | None:
        if value:
            raise PydanticCustomError("unserved", "is not supported (use repetition_penalty)")
        return value

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        sampling = request.sampling
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "seed"):
            if getattr(self, name) is not None:
                setattr(sampling, name, getattr(self, name))
        sampling.top_k = max(self.top_k or 0, 0)


def _stops(value: object) -> object:
    return [value] if isinstance(value, str) else value


class Stopping(FieldGroup):
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    min_tokens: Uint32 | None = None
    stop: Annotated[list[Text], BeforeValidator(_stops)] | None = None
    ignore_eos: bool | None = None

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        stopping = request.stopping
        stopping.max_new_tokens = self.max_tokens or 0  # 0: parse() puts the default
        stopping.min_new_tokens = self.min_tokens or 0
        stopping.stop_strings.extend(self.stop or ())
        stopping.ignore_eos = bool(self.ignore_eos)


class ChatStopping(Stopping):
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        Stopping.apply(self, request)
        if self.max_completion_tokens is not None:
            request.stopping.max_new_tokens = self.max_completion_tokens


class CompletionLogprobs(FieldGroup):
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def num_logprobs(self) -> int | None:
        """None: none asked; else the number of top alternatives."""
        return self.logprobs

    def apply(self, request: gateway_pb2.GenerateRequest) -> None:
        if self.num_logprobs() is not None:
            request.sampling.logprobs = self.num_logprobs()


class ChatLogprobs(FieldGroup):
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("needs_logprobs", "needs logprobs: true")
        return value

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    apply = CompletionLogprobs.apply


class StreamOptions(Strict):
    include_usage: bool | None = None


class Choices(FieldGroup):
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


def _refuse_set(value: object) -> object:
    if value not in (None, False, [], {}):
        raise PydanticCustomError("unserved", "is not supported by this server")
    return value


def _unserved_group(names: tuple[str, ...]) -> type[FieldGroup]:
    fields: Any = {name: (Annotated[Any, AfterValidator(_refuse_set)], None) for name in names}
    return create_model("Unserved", __base__=FieldGroup, **fields)


Unserved = _unserved_group(UNSERVED)
COMPLETION_GROUPS: tuple[type[FieldGroup], ...] = (
    ModelField, CompletionPrompt, Sampling, Stopping, CompletionLogprobs, Choices, Unserved)
CHAT_GROUPS: tuple[type[FieldGroup], ...] = (
    ModelField, ChatMessages, Sampling, ChatStopping, ChatLogprobs, Choices, Unserved)


def body_model(groups: tuple[type[FieldGroup], ...], name: str) -> type[FieldGroup]:
    """One model with every group's fields (errors in the order of ``groups``)."""
    return create_model(name, __base__=tuple(reversed(groups)))


CompletionBody = body_model(COMPLETION_GROUPS, "CompletionBody")
ChatBody = body_model(CHAT_GROUPS, "ChatBody")


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
    body: Any = None  # the validated body (every group's fields), for what the response needs
    tools: structured.ToolPlan | None = None  # chat with tools: how replies become tool calls


def parse(body: object, chat: bool, default_max_tokens: int) -> Parsed:
    """Check an OpenAI completions (``chat`` False) or chat completions body; raise
    ``ApiError`` (400 naming the field) when it cannot be served."""
    if not isinstance(body, dict):
        raise bad_field("body", "must be a JSON object")
    body, extra = structured.parse(body, chat)  # tools, response_format, guided_*
    try:
        fields: Any = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    request = gateway_pb2.GenerateRequest()
    for group in CHAT_GROUPS if chat else COMPLETION_GROUPS:
        group.apply(fields, request)
    if extra.constraint is not None:
        request.constraint.CopyFrom(extra.constraint)
    if not request.stopping.max_new_tokens:
        request.stopping.max_new_tokens = default_max_tokens
    options = fields.stream_options
    return Parsed(chat=chat, model=fields.model, requests=tuple(_choice(request, i) for i in range(fields.n or 1)),
                  stream=bool(fields.stream), include_usage=bool(options and options.include_usage),
                  logprobs=fields.num_logprobs(), body=fields, tools=extra.tools)


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
