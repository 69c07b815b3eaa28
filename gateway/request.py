"""One request at the gateway, from validation to its last chunk: what was validated, what
the client has been sent, and where the time went.

Everything about a request that outlives one routing attempt lives here, so an attempt
(``gateway/legs.py``) needs only this object and the registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.text import TextStream
from gateway.validation import ValidatedRequest
from plumbing.metrics import GatewayMetrics
from splitserve.v1 import common_pb2, gateway_pb2


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
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)  # the prompt's, by block size (routing)
    num_tokens: int = 0  # sent to the client
    last_emit: float = 0.0
    first_token_at: float = 0.0
    timings: common_pb2.PhaseTimings | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.validated.prompt_token_ids

    @property
    def streamed(self) -> bool:
        """True once any token reached the client (no silent retry after that)."""
        return self.num_tokens > 0

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
        self.num_tokens += len(token_ids)
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
            if decode_timings.prefill_us:
                timings.prefill_us = decode_timings.prefill_us
            if not timings.num_cached_prompt_tokens:
                timings.num_cached_prompt_tokens = decode_timings.num_cached_prompt_tokens
        now = time.monotonic()
        timings.first_token_us = int(((self.first_token_at or now) - self.start) * 1e6)
        timings.total_us = int((now - self.start) * 1e6)
        return gateway_pb2.GenerateResponse(
            request_id=self.request_id, text=self.text.flush(),
            finish_reason=reason or common_pb2.FINISH_REASON_STOP, timings=timings,
            num_prompt_tokens=len(self.prompt_token_ids),
        )
