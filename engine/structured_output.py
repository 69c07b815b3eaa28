"""The engine's structured-output part: constrained requests wait for their grammar, then
their matcher follows every token they produce.

* Admission: a constrained request's grammar compiles on the compiler's thread
  (``GrammarCompiler.submit``); the request joins the scheduler only once its matcher is
  ready, so no step ever waits on a compile. The matcher first replays the tokens the request
  generated before it came here (a migrated request's ``num_prior_draws`` prompt tokens, a
  prefilled request's first token): no grammar state crosses a process boundary.
* Steps: the runner masks constrained rows (``engine/grammar_masks.py``); after the step each
  matcher advances over the request's new tokens; a request whose grammar is complete
  finishes ``stop`` at once. A reply cut by ``max_tokens`` still finishes ``length``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from engine.grammar import GrammarCompiler, GrammarState
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.scheduler import Scheduler, SchedulerOutput

log = structlog.get_logger()

# While nothing else runs, a step waits this long for a compile instead of spinning.
_IDLE_COMPILE_WAIT_S = 0.005


@dataclass
class _Pending:
    request: Request
    future: Future[GrammarState]
    replay: list[int]  # tokens generated before this engine saw the request
    admit: Callable[[Request], None]


class StructuredOutput:
    """Mixin of ``Engine``: the pending grammars and the matchers' bookkeeping."""

    grammars: GrammarCompiler | None
    scheduler: Scheduler
    _pending_grammars: dict[str, _Pending]
    _make_output: Callable[[Request, int], RequestOutput]  # Engine's

    def _init_structured_output(self, tokenizer: object, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._pending_grammars = {}

    def _defer_until_compiled(self, request: Request, num_prior: int, admit: Callable[[Request], None]) -> bool:
        """Start compiling a constrained request's grammar and hold the request until it is
        ready; False (nothing done) for an unconstrained request."""
        constraint = request.sampling_params.constraint
        if constraint is None:
            return False
        if self.grammars is None:
            raise ValueError("constraint: this model has no tokenizer to compile grammars with")
        replay = request.prompt_token_ids[len(request.prompt_token_ids) - num_prior:] if num_prior else []
        future = self.grammars.submit(constraint)
        self._pending_grammars[request.request_id] = _Pending(request, future, replay, admit)
        return True

    def _admit_compiled(self) -> list[RequestOutput]:
        """Admit the requests whose grammar is ready; the outputs of those that failed."""
        if not self._pending_grammars:
            return []
        if not self.scheduler.has_unfinished():
            futures = [p.future for p in self._pending_grammars.values()]
            concurrent.futures.wait(futures, _IDLE_COMPILE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        failed = []
        for request_id, pending in list(self._pending_grammars.items()):
            if not pending.future.done():
                continue
            del self._pending_grammars[request_id]
            request = pending.request
            error = pending.future.exception()
            state = pending.future.result() if error is None else None
            if state is not None and state.accept(pending.replay + request.output_token_ids):
                request.grammar = state
                pending.admit(request)
                continue
            reason = str(error) if error is not None else f"replayed tokens refused: {state.error if state else ''}"
            log.warning("engine.constraint_failed", request_id=request_id, reason=reason)
            self.scheduler.abort(request_id)  # frees its blocks (reserved or running), if any
            request.status = RequestStatus.FINISHED_ABORTED
            failed.append(self._make_output(request, request.num_output_tokens))
        return failed

    def _drop_pending_grammar(self, request_id: str) -> bool:
        return self._pending_grammars.pop(request_id, None) is not None

    def _advance_grammars(self, out: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
        """Feed each constrained request's new tokens to its matcher (before the scheduler
        appends them). Tokens after a stop token may be refused: the request ends there."""
        for item in out.scheduled:
            grammar = item.request.grammar
            new_tokens = tokens.get(item.request.request_id)
            if grammar is not None and new_tokens:
                grammar.accept(new_tokens)

    def _finish_completed_grammars(self, out: SchedulerOutput) -> None:
        """A request whose grammar admits nothing more (but EOS) is done: ``stop``."""
        for item in out.scheduled:
            request = item.request
            if request.grammar is not None and not request.status.finished and request.grammar.is_stopped:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
