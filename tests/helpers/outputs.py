"""Test-side assembly of ``Engine.step()`` outputs (deltas) into whole requests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.outputs import CompletionOutput, RequestOutput


class Completions:
    """Request id -> the request's ``CompletionOutput`` so far."""

    def __init__(self) -> None:
        self.by_id: dict[str, CompletionOutput] = {}

    def expect(
        self, request_id: str, prompt: Sequence[int], first_token_id: int | None = None,
        first_logprob: float | None = None, first_top_logprobs: dict[int, float] | None = None,
    ) -> None:
        """Start a request; an admitted one (``admit_prefilled``) starts with its first token,
        which its step outputs never carry."""
        completion = CompletionOutput(request_id, list(prompt))
        if first_token_id is not None:
            completion.add(RequestOutput(
                request_id, [first_token_id],
                new_logprobs=None if first_logprob is None else [first_logprob],
                new_top_logprobs=None if first_top_logprobs is None else [first_top_logprobs],
            ))
        self.by_id[request_id] = completion

    def feed(self, outputs: Iterable[RequestOutput]) -> list[CompletionOutput]:
        """Add one step's outputs; return the requests that finished with them."""
        finished = []
        for out in outputs:
            completion = self.by_id.setdefault(out.request_id, CompletionOutput(out.request_id, []))
            completion.add(out)
            if out.finished:
                finished.append(completion)
        return finished

    def __getitem__(self, request_id: str) -> CompletionOutput:
        return self.by_id[request_id]
