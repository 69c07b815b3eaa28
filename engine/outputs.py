"""What the engine hands back (plain data; services convert it to protobuf).

``step()`` returns one :class:`RequestOutput` per request that advanced, holding only what
that step added, so a step's output work does not grow with how much a request has
generated. :class:`CompletionOutput` assembles a whole request from its outputs
(``Engine.generate`` returns those).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.metrics import SpecDecodeStats


@dataclass
class RequestOutput:
    """What one step added to one request.

    ``new_logprobs[i]`` is the raw-model log-probability of ``new_token_ids[i]``;
    ``new_top_logprobs[i]`` maps the top-n alternatives to theirs (both None unless the
    request asked for logprobs). ``new_text`` is empty when the engine does not detokenize
    (``EngineConfig.detokenize``). Counters are totals so far.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[dict[int, float]] | None = None
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_output_tokens: int = 0  # generated so far, these included
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of which the target accepted
    error: str | None = None  # finish_reason "error": why no token could be given


@dataclass
class CompletionOutput:
    """A request's whole output, assembled by :meth:`add` from its ``RequestOutput`` s."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        """Append one step's output (mutates ``self``)."""
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        if out.new_top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + out.new_top_logprobs
        self.finished, self.finish_reason = out.finished, out.finish_reason
        self.num_cached_tokens = out.num_cached_tokens
        self.num_preemptions = out.num_preemptions
        self.num_draft_tokens = out.num_draft_tokens
        self.num_accepted_tokens = out.num_accepted_tokens
        self.error = out.error


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, taken on the engine thread (``Engine.load``) and
    safe to read from any thread afterwards: it shares no state with the engine."""

    num_blocks_total: int
    num_blocks_free: int  # cached-but-evictable blocks count as free
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int  # prompt tokens queued and not yet computed
    spec: SpecDecodeStats | None = None  # a copy of the speculative-decoding counters
    num_cached_prompt_tokens: int = 0  # since start: prompt tokens served by the prefix cache
    num_received_prompt_tokens: int = 0  # since start: prompt tokens whose pages arrived
    num_blocks_in_transfer: int = 0  # held for a transfer out, or owned by requests WAITING_FOR_REMOTE_KVS
