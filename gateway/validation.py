"""Request validation at the gateway: every rejection names the field (INVALID_ARGUMENT)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import unknown_fields

from engine.chat import ChatTemplate
from engine.sampling_params import SamplingParams
from plumbing.convert import sampling_params_from_proto, sampling_params_to_proto
from splitserve.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class ValidatedRequest:
    """What validation produced, once: the workers get ``sampling``/``stopping``, the
    canonical form of ``params`` (stop strings stay at the gateway)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    sampling: common_pb2.SamplingParams
    stopping: common_pb2.StoppingCriteria


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_stop_strings: int
    max_stop_string_bytes: int


def _is_repeated(descriptor: Any) -> bool:
    if hasattr(descriptor, "is_repeated"):  # protobuf >= 5.29 (``label`` is gone in 7)
        return bool(descriptor.is_repeated)
    return descriptor.label == descriptor.LABEL_REPEATED


def _reject_unknown_fields(message: Any, path: str) -> None:
    """Fields this server does not know are an error, not silently ignored."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise ValueError(f"{path or 'request'}: unknown field number(s) {numbers}")
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None and not _is_repeated(descriptor):
            if not descriptor.message_type.GetOptions().map_entry:
                _reject_unknown_fields(value, f"{path}.{descriptor.name}".lstrip("."))


_ROLE_NAMES = {gateway_pb2.CHAT_ROLE_SYSTEM: "system", gateway_pb2.CHAT_ROLE_USER: "user",
               gateway_pb2.CHAT_ROLE_ASSISTANT: "assistant"}


def _chat_prompt(request: gateway_pb2.GenerateRequest, chat: ChatTemplate | None) -> list[int]:
    if chat is None:
        raise ValueError("prompt.chat: this model has no chat template; send prompt.text or prompt.token_ids")
    messages = []
    for i, message in enumerate(request.chat.messages):
        if message.role not in _ROLE_NAMES:
            raise ValueError(f"prompt.chat.messages[{i}].role must be set (system, user or assistant)")
        messages.append((_ROLE_NAMES[message.role], message.content))
    return chat.render(messages, field="prompt.chat.messages")


def validate(request: gateway_pb2.GenerateRequest, tokenizer: Any, limits: Limits,
             chat: ChatTemplate | None = None) -> ValidatedRequest:
    """Raise ``ValueError`` naming the offending field; return what the workers need.
    ``chat``: the model's chat template, for ``prompt.chat`` (None: the model has none)."""
    _reject_unknown_fields(request, "")
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt: set text, token_ids or chat")
    if which == "chat":
        prompt = _chat_prompt(request, chat)
    elif which == "text":
        if not request.text:
            raise ValueError("prompt.text must not be empty")
        if tokenizer is None:
            raise ValueError("prompt.text: this model has no tokenizer; send prompt.token_ids")
        prompt = list(tokenizer.encode(request.text))
        if not prompt:
            raise ValueError("prompt.text tokenizes to no tokens")
    else:
        prompt = list(request.token_ids.ids)
        if not prompt:
            raise ValueError("prompt.token_ids must not be empty")
        bad = next((t for t in prompt if t >= limits.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt.token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if not request.HasField("stopping") or request.stopping.max_new_tokens < 1:
        raise ValueError("stopping.max_new_tokens must be >= 1")
    if len(prompt) >= limits.max_model_len:
        raise ValueError(
            f"prompt is {len(prompt)} tokens; max_model_len={limits.max_model_len} leaves no room for output"
        )
    budget = limits.max_model_len - len(prompt)
    if request.stopping.max_new_tokens > budget:
        raise ValueError(
            f"stopping.max_new_tokens={request.stopping.max_new_tokens} exceeds what max_model_len="
            f"{limits.max_model_len} leaves after a {len(prompt)}-token prompt ({budget})"
        )
    stops = tuple(request.stopping.stop_strings)
    if len(stops) > limits.max_stop_strings:
        raise ValueError(f"stopping.stop_strings: at most {limits.max_stop_strings}, got {len(stops)}")
    for s in stops:
        if not s or len(s.encode()) > limits.max_stop_string_bytes:
            raise ValueError(
                f"stopping.stop_strings: each must be 1..{limits.max_stop_string_bytes} bytes"
            )
    bad_stop = next((t for t in request.stopping.stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise ValueError(f"stopping.stop_token_ids: {bad_stop} is outside the vocabulary")
    params = sampling_params_from_proto(request.sampling, request.stopping)
    if which == "chat" and chat is not None and not params.ignore_eos:
        end_ids = tuple(t for t in chat.end_of_turn_ids if t not in params.stop_token_ids)
        params = replace(params, stop_token_ids=params.stop_token_ids + end_ids)
    return ValidatedRequest(prompt, params, stops, *sampling_params_to_proto(params))
