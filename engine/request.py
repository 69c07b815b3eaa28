"""Request state: the one place that tracks a request's tokens and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    # Decode worker: blocks reserved under the request's id, its prompt K/V computed by a
    # prefill worker and not yet all here (as vLLM v1's WAITING_FOR_REMOTE_KVS). In no queue;
    # admission (``Engine.handoff.admit_prefilled``) makes it WAITING in the scheduler's
    # ``prefilled`` queue, freeing (a failed hand-off, ``abort``) ends it FINISHED_ABORTED.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    # The model's logits for the request's next token were not all finite (NaN or inf: an
    # overflow in half precision, a corrupt weight, a fault): no token can be given, so the
    # request ends with an error, never with the argmax of NaNs.
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """A generation request as the scheduler sees it.

    ``all_token_ids`` = prompt + generated tokens. ``num_computed_tokens`` counts the
    prefix of ``all_token_ids`` whose K/V sit in the request's blocks (prefix-cache hits
    included). The request samples a token in a step whose scheduled tokens reach
    ``num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    generator: Any = None  # torch.Generator for seeded requests, made by the runner
    # Prefill worker: on a normal finish keep the prompt's blocks (held) for KV transfer
    # instead of freeing them; ``Engine.handoff.release_kv`` frees them.
    hold_kv: bool = False
    # Filled as the request runs (metrics and logprobs).
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    first_token_time: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: drafts proposed for the next step (and the distribution each
    # was drawn from, [k, vocab], or None for deterministic n-gram drafts), and how many
    # leading tokens have K/V in the draft model's cache.
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None
    draft_num_computed: int = 0
    num_draft_tokens: int = 0  # drafts verified over the request's life
    num_accepted_tokens: int = 0  # of which accepted
    # Structured output: the request's grammar matcher (engine.grammar.GrammarState), advanced
    # over every token the request produced; None for an unconstrained request.
    grammar: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
