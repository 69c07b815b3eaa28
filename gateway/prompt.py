"""A request's prompt as token ids: cheap size checks first (on the event loop), then the
costly part (tokenizing text, rendering a chat) on the gateway's tokenizer thread.

The byte cap. A text prompt (or a chat's contents together) longer than ``max_prompt_bytes``
= ``max_model_len`` × ``bytes_per_token`` is rejected before it is tokenized (INVALID_ARGUMENT
naming ``prompt.text`` / ``prompt.chat.messages``). ``bytes_per_token`` is the longest token
of the model's vocabulary in UTF-8 bytes (``max_token_bytes``; 45 for the bundled model, 81
for SmolLM2), at most ``MAX_BYTES_PER_TOKEN``. A prompt tokenizes to at least bytes ÷ longest
token tokens (a token never stands for more bytes than that), so the cap never refuses a
prompt that would fit ``max_model_len``; it only bounds what one request can make the
tokenizer chew on (a 3.9 MB prompt is refused in microseconds instead of costing seconds).
A chat may hold at most ``max_model_len`` messages (each renders to one token at least).
A token-id prompt is checked for length before its ids are scanned (the prompt rule,
``engine/prompt_check.py``, is applied whole by ``validation.finish``).
"""

from __future__ import annotations

from typing import Any

from engine.chat import ChatTemplate
from engine.prompt_check import check_prompt_len
from splitserve_api.v1 import gateway_pb2

MAX_BYTES_PER_TOKEN = 128

_ROLE_NAMES = {gateway_pb2.CHAT_ROLE_SYSTEM: "system", gateway_pb2.CHAT_ROLE_USER: "user",
               gateway_pb2.CHAT_ROLE_ASSISTANT: "assistant"}


def max_token_bytes(tokenizer: Any | None) -> int:
    """The longest token of ``tokenizer``'s vocabulary in UTF-8 bytes, capped at
    ``MAX_BYTES_PER_TOKEN`` (that cap without a tokenizer)."""
    if tokenizer is None:
        return MAX_BYTES_PER_TOKEN
    longest = max((len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer))), default=1)
    return max(1, min(longest, MAX_BYTES_PER_TOKEN))


def check_prompt_size(request: gateway_pb2.GenerateRequest, max_model_len: int, max_prompt_bytes: int) -> None:
    """Cheap checks on the event loop: a prompt is set and not empty, and within the caps."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt: set text, token_ids or chat")
    if which == "text":
        if not request.text:
            raise ValueError("prompt.text must not be empty")
        num_bytes = len(request.text.encode())
        if num_bytes > max_prompt_bytes:
            raise ValueError(f"prompt.text is {num_bytes} bytes; at most {max_prompt_bytes} "
                             f"(max_model_len={max_model_len} tokens) are accepted")
    elif which == "chat":
        messages = request.chat.messages
        if len(messages) > max_model_len:
            raise ValueError(f"prompt.chat.messages: {len(messages)} messages; at most {max_model_len}")
        num_bytes = sum(len(m.content.encode()) for m in messages)
        if num_bytes > max_prompt_bytes:
            raise ValueError(f"prompt.chat.messages: {num_bytes} bytes of content; at most "
                             f"{max_prompt_bytes} (max_model_len={max_model_len} tokens) are accepted")
    else:  # its length before its ids are scanned (the rest of the rule: validation.finish)
        check_prompt_len(len(request.token_ids.ids), max_model_len, "prompt.token_ids")


def prompt_token_ids(request: gateway_pb2.GenerateRequest, tokenizer: Any | None,
                     chat: ChatTemplate | None) -> list[int]:
    """The prompt's token ids (tokenizer thread: this is where the time goes), not yet
    checked: ``validation.finish`` applies the prompt rule (``engine/prompt_check.py``)."""
    which = request.WhichOneof("prompt")
    if which == "chat":
        return _chat_prompt(request, chat)
    if which == "text":
        if tokenizer is None:
            raise ValueError("prompt.text: this model has no tokenizer; send prompt.token_ids")
        return list(tokenizer.encode(request.text))
    return list(request.token_ids.ids)


def prompt_field(request: gateway_pb2.GenerateRequest) -> str:
    """The field a prompt's rejection names: ``prompt.text``, ``prompt.token_ids`` or ``prompt.chat``."""
    return f"prompt.{request.WhichOneof('prompt')}"


def _chat_prompt(request: gateway_pb2.GenerateRequest, chat: ChatTemplate | None) -> list[int]:
    if chat is None:
        raise ValueError("prompt.chat: this model has no chat template; send prompt.text or prompt.token_ids")
    messages = []
    for i, message in enumerate(request.chat.messages):
        if message.role not in _ROLE_NAMES:
            raise ValueError(f"prompt.chat.messages[{i}].role must be set (system, user or assistant)")
        messages.append((_ROLE_NAMES[message.role], message.content))
    return chat.render(messages, field="prompt.chat.messages")
