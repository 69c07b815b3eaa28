"""What the engine hands back for a request (plain data; services convert it to protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """Cumulative state of one request after a step.

    ``new_token_ids`` / ``new_text`` hold what this step added (for streaming);
    ``token_ids`` / ``text`` everything generated so far. ``logprobs[i]`` is the raw-model
    log-probability of ``token_ids[i]``; ``top_logprobs[i]`` maps the top-n alternatives to
    theirs (both None unless the request asked for logprobs).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of which the target accepted
