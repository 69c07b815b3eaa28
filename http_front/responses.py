"""The OpenAI response objects, built from the gateway's ``GenerateResponse`` chunks.

The front has no tokenizer (the gateway owns it), so a logprob's token is named by its id
as ``"token_id:<id>"``, the form vLLM's ``--return-tokens-as-token-ids`` uses.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from splitserve_api.v1 import common_pb2, gateway_pb2

_FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
           common_pb2.FINISH_REASON_ABORT: "abort"}


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


@dataclass
class Choice:
    """One choice as its chunks arrive (owned by the request's handler)."""

    index: int
    text: str = ""
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, chunk: gateway_pb2.GenerateResponse) -> None:
        self.text += chunk.text
        self.num_tokens += len(chunk.token_ids)
        self.logprobs += chunk.logprobs
        if chunk.finish_reason:
            self.finish_reason = _FINISH.get(chunk.finish_reason, "stop")
            self.num_prompt_tokens = chunk.num_prompt_tokens


def completion_logprobs(logprobs: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"tokens": [token_name(lp.token_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_name(t): v for t, v in sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])}
                             for lp in logprobs],
            "text_offset": None}


def chat_logprobs(logprobs: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": token_name(lp.token_id), "logprob": lp.logprob, "bytes": None,
                         "top_logprobs": [{"token": token_name(t), "logprob": v, "bytes": None}
                                          for t, v in sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])]}
                        for lp in logprobs]}


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = choices[0].num_prompt_tokens if choices else 0
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole(chat: bool, rid: str, model: str, choices: list[Choice], logprobs: bool) -> dict[str, Any]:
    """The non-streaming response."""
    body: list[dict[str, Any]] = []
    for c in choices:
        lp = (chat_logprobs if chat else completion_logprobs)(c.logprobs) if logprobs else None
        item: dict[str, Any] = {"index": c.index, "logprobs": lp, "finish_reason": c.finish_reason}
        if chat:
            item["message"] = {"role": "assistant", "content": c.text}
        else:
            item["text"] = c.text
        body.append(item)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": body, "usage": usage(choices)}


def chunk(chat: bool, rid: str, model: str, index: int, update: gateway_pb2.GenerateResponse | None,
          finish_reason: str | None, logprobs: bool, first: bool = False) -> dict[str, Any]:
    """One streamed chunk for choice ``index``: ``update``'s text (and logprobs), the finish
    reason on the last; a chat stream's first chunk carries the role."""
    text = update.text if update is not None else ""
    lps = list(update.logprobs) if update is not None else []
    lp = (chat_logprobs if chat else completion_logprobs)(lps) if logprobs and lps else None
    item: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": finish_reason}
    if chat:
        item["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    else:
        item["text"] = text
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [item]}


def usage_chunk(chat: bool, rid: str, model: str, choices: list[Choice]) -> dict[str, Any]:
    """The last chunk of a stream asked for with ``stream_options.include_usage``."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(choices)}
