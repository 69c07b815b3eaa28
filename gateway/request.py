"""One request at the gateway, from validation to its last chunk: what was validated, what
the client has been sent, and where the time went.

Everything about a request that outlives one routing attempt lives here, so an attempt
(``gateway/legs.py``) needs only this object and the registry. An attempt after tokens
reached the client is a *migration*: it continues the request from what was sent
(``attempt_prompt``: the prompt plus the sent tokens; ``attempt_stopping``: the budgets
counted down; ``num_sent`` tokens whose draws a seeded generator skips).

A *resumed* request (``GenerateRequest.resume``: its client lost a stream, maybe on another
gateway) starts as a migration does: ``resume`` puts the tokens the client already has in
``token_ids`` and replays them through the ``TextStream`` (their text is the client's too), so
every attempt prefills prompt + those tokens, the budgets count them and a seeded generator
skips their draws; only what follows them is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.stopping import finish_reason
from gateway.text import TextStream
from gateway.validation import Limits, ValidatedRequest
from plumbing.convert import FINISH_REASONS
from plumbing.metrics import GatewayMetrics
from splitserve_api.v1 import common_pb2, gateway_pb2


@dataclass(eq=False)
class GatewayRequest:
    """Per-request state; owned by the request's handler task on the event loop."""

    request_id: int
    validated: ValidatedRequest
    text: TextStream
    metadata: tuple[tuple[str, str], ...]  # forwarded to the workers (x-request-id, traceparent)
    time_remaining: Callable[[], float | None]  # the client's deadline, in seconds from now
    metrics: GatewayMetrics
    start: float = field(default_factory=time.monotonic)
    excluded: set[int] = field(default_factory=set)  # workers that failed this request
    token_ids: list[int] = field(default_factory=list)  # generated and sent to the client
    migrations: int = 0  # continuations on another decode worker after tokens were sent
    num_resumed_tokens: int = 0  # the first of token_ids, which the client had before this request (resume)
    block_hashes: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)  # by (block size, prompt length): routing
    last_emit: float = 0.0
    first_token_at: float = 0.0
    timings: common_pb2.PhaseTimings | None = None  # the path to the first token (set by the attempt that sent it)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.validated.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def streamed(self) -> bool:
        """True once this request sent a token (a failure then migrates the request)."""
        return len(self.token_ids) > self.num_resumed_tokens

    def resume(self) -> None:
        """Take the validated ``resume.token_ids`` as already sent (their text included)."""
        ids = list(self.validated.resume_token_ids)
        self.token_ids = ids
        self.num_resumed_tokens = len(ids)
        self.text.add(ids)  # the client has this text (or holds it back, as we now do)
        if self.validated.num_resumes:
            self.metrics.resumes.inc()

    def finished_on_resume(self, limits: Limits) -> int | None:
        """The finish reason of a resumed request whose tokens already end it (the client's
        stream broke before the final chunk); None when it must go on."""
        if not self.num_resumed_tokens:
            return None
        if self.text.stopped:
            return common_pb2.FINISH_REASON_STOP
        return self.finished_by_sent(limits)

    @property
    def attempt_prompt(self) -> list[int]:
        """What the next attempt prefills: the prompt, then every token already sent."""
        return self.validated.prompt_token_ids + self.token_ids

    @property
    def attempt_stopping(self) -> common_pb2.StoppingCriteria:
        """The stopping criteria of the next attempt: what is left of the token budgets."""
        stopping = common_pb2.StoppingCriteria()
        stopping.CopyFrom(self.validated.stopping)
        stopping.max_new_tokens -= self.num_tokens
        stopping.min_new_tokens = max(0, stopping.min_new_tokens - self.num_tokens)
        return stopping

    def finished_by_sent(self, limits: Limits) -> int | None:
        """The finish reason the tokens already sent imply (the worker died before saying
        so), by the engine's own rule (``engine/stopping.py``); None when the request must go on."""
        if not self.token_ids:
            return None
        n = self.num_tokens
        reason = finish_reason(self.validated.params, self.token_ids[-1], n, len(self.prompt_token_ids) + n,
                               limits.max_model_len, limits.eos_token_ids)
        return None if reason is None else FINISH_REASONS[reason]

    def emit(self, token_ids: list[int], logprobs: list[common_pb2.TokenLogprob]) -> gateway_pb2.GenerateResponse:
        """The chunk that sends ``token_ids`` to the client (text as far as it is decided)."""
        now = time.monotonic()
        if not self.streamed:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.start)
        elif token_ids:
            gap = (now - self.last_emit) / len(token_ids)
            for _ in token_ids:
                self.metrics.itl.observe(gap)
        self.token_ids += token_ids
        self.last_emit = now
        return gateway_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids,
                                            text=self.text.add(token_ids), logprobs=logprobs)

    def final(self, reason: int, decode_timings: common_pb2.PhaseTimings | None) -> gateway_pb2.GenerateResponse:
        """The last chunk: held-back text, finish reason, timings."""
        timings = common_pb2.PhaseTimings()
        if self.timings is not None:
            timings.CopyFrom(self.timings)
        if decode_timings is not None:
            timings.num_draft_tokens = decode_timings.num_draft_tokens
            timings.num_accepted_tokens = decode_timings.num_accepted_tokens
            if decode_timings.prefill_us and not self.migrations:  # a local prefill: its time
                timings.prefill_us = decode_timings.prefill_us
            if not timings.num_cached_prompt_tokens and not self.migrations:
                timings.num_cached_prompt_tokens = decode_timings.num_cached_prompt_tokens
            if not self.migrations:  # the pages were written on the decode side after the last send
                timings.transfer_us = max(timings.transfer_us, decode_timings.transfer_us)
        timings.migrations = self.migrations
        timings.resumes = self.validated.num_resumes
        now = time.monotonic()
        timings.first_token_us = int(((self.first_token_at or now) - self.start) * 1e6)
        timings.total_us = int((now - self.start) * 1e6)
        return gateway_pb2.GenerateResponse(
            request_id=self.request_id, text=self.text.flush(),
            finish_reason=reason or common_pb2.FINISH_REASON_STOP, timings=timings,
            num_prompt_tokens=len(self.prompt_token_ids),
        )
