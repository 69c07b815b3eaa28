"""Iteration-level scheduler: continuous batching with chunked prefill and preemption.

Each ``schedule()`` builds one ragged batch under two budgets: ``max_num_batched_tokens``
tokens and the KV pool. Running requests go first (in admission order): a decode asks for
one token, an unfinished prefill for its next chunk. When the pool cannot grow a running
request, the newest running request is preempted (its blocks are freed and it will be
recomputed from its tokens; prefix caching usually makes that cheap). Waiting requests are
admitted FCFS after that, with prefix-cache hits, until a budget runs out. A step that
preempted admits nobody.

Disaggregated serving adds two ways in and out (block tables in ``KVCacheManager``):

* a request added with ``hold_kv`` that finishes normally keeps its prompt blocks
  (``kv.hold``) for the prefill worker to ship; an aborted one frees everything;
* ``reserve`` takes the blocks of a request whose prompt K/V another worker computes; it
  waits, in no queue, as WAITING_FOR_REMOTE_KVS;
* ``add_prefilled`` admits it once its prompt K/V were received and its first token is
  sampled. It waits in ``prefilled`` and joins the running batch after the running
  requests and ahead of waiting ones (under ``max_num_seqs``), costing one token.

The scheduler mutates request state and the KV cache manager; the model runner only reads
the ``SchedulerOutput``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.stopping import LENGTH, STOP, finish_reason

_FINISHED_BY = {STOP: RequestStatus.FINISHED_STOPPED, LENGTH: RequestStatus.FINISHED_LENGTH}


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    ``num_new_tokens`` counts every row run through the model from ``num_computed_tokens``:
    the request's own tokens, then its ``spec_token_ids`` (drafts to verify), which are
    not part of ``all_token_ids`` until accepted.
    """

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the request's tokens (so it samples)."""
        request = self.request
        return request.num_computed_tokens + self.num_real_tokens == request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hits of the requests admitted this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilled: deque[Request] = deque()  # prompt K/V received, not yet running
        self.requests: dict[str, Request] = {}

    # -- queue operations -------------------------------------------------------------
    def is_known(self, request_id: str) -> bool:
        """True while the id is queued, running, waiting for remote KV, or holds blocks."""
        return request_id in self.requests or self.kv.holds_transfer(request_id)

    def add(self, request: Request) -> None:
        if self.is_known(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> list[int] | None:
        """Take the blocks of a new request whose prompt K/V another worker computes
        (``KVCacheManager.reserve``); it waits as WAITING_FOR_REMOTE_KVS, in no queue, until
        ``add_prefilled`` or ``abort``. None, and no change, if the pool cannot now."""
        block_ids = self.kv.reserve(request)
        if block_ids is not None:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.requests[request.request_id] = request
        return block_ids

    def add_prefilled(self, request: Request) -> bool:
        """Admit a reserved request whose prompt K/V are in its blocks
        (``num_computed_tokens`` = prompt length) and whose first output token is appended:
        it waits in ``prefilled`` (WAITING). Its full prompt blocks are published to the
        prefix cache. Returns False if that first token already finishes it: its blocks are
        then freed and it is not queued."""
        self.kv.cache_computed_blocks(request)
        status = self._stop_status(request, request.output_token_ids[-1])
        if status is not None:
            self.finish(request, status)
            return False
        request.status = RequestStatus.WAITING
        self.prefilled.append(request)
        return True

    def abort(self, request_id: str) -> bool:
        """Finish a request (queued, running or waiting for remote KV) as aborted and free its
        blocks at once; blocks held under the id are freed too. False if the id is unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            return True
        return self.kv.release(request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a request. A ``hold_kv`` request that stopped normally keeps the blocks of
        its prompt (held for transfer); every other block is freed. A request that failed
        (FINISHED_ERROR: non-finite logits) also withdraws the blocks it alone published from
        the prefix cache: their K/V may hold the same NaNs, and no later prompt may reuse them."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.prefilled:
            self.prefilled.remove(request)
        if request.hold_kv and status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self.kv.hold(request, request.num_prompt_tokens)
        else:
            self.kv.free(request, unpublish=status is RequestStatus.FINISHED_ERROR)
        self.requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        """True while a request is queued or running (one waiting for remote KV waits on the
        transfer, not on a step)."""
        return bool(self.waiting or self.running or self.prefilled)

    def waiting_for_remote_kvs(self) -> list[Request]:
        return [r for r in self.requests.values() if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS]

    # -- the step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_prefilled(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._schedule_with_drafts(out, request, budget):
                budget -= out.scheduled[-1].num_new_tokens
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest admitted goes first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_with_drafts(self, out: SchedulerOutput, request: Request, budget: int) -> bool:
        """Schedule a decode plus its drafts if the budget and the pool allow; else drop the
        drafts (the request then decodes one token) and return False."""
        drafts = request.spec_token_ids
        if not drafts:
            return False
        num_new = 1 + len(drafts)
        is_decode = request.num_tokens - request.num_computed_tokens == 1
        if is_decode and num_new <= budget and self.kv.allocate_slots(request, num_new):
            out.scheduled.append(ScheduledRequest(request, num_new, list(drafts)))
            return True
        request.spec_token_ids = []
        request.draft_probs = None
        return False

    def _schedule_prefilled(self, out: SchedulerOutput, budget: int) -> int:
        """Move admitted requests into the batch, in admission order: each runs its first
        output token (one token, at most one new block). If one cannot get its block while
        nothing is running (so nothing will free one), the newest admitted request is
        preempted and recomputes locally: admitted requests never wait on each other."""
        while self.prefilled and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.prefilled[0]
            if not self.kv.allocate_slots(request, 1):
                if self.running:
                    break
                victim = self.prefilled.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                continue
            self.prefilled.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, 1))
            budget -= 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
            out.num_cached_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_num_computed = 0
        request.spec_token_ids = []
        request.draft_probs = None
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward -----------------------------------------------------------
    def update_after_step(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        num_accepted: dict[str, int] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish on stop conditions.

        ``sampled`` maps request id -> the tokens this step produced (one, or with
        speculation the accepted drafts plus a recovered/bonus token); ``num_accepted`` maps
        a speculating request id -> its accepted draft count. Slots written for rejected
        drafts are released at once. Returns the requests that finished in this step
        (their blocks are already free).
        """
        accepted_counts = num_accepted or {}
        finished: list[Request] = []
        for item in out.scheduled:
            request = item.request
            if request.status.finished:
                continue  # aborted mid-step
            old_num_tokens = request.num_tokens
            num_accepted_drafts = accepted_counts.get(request.request_id, 0)
            request.num_computed_tokens += item.num_real_tokens + num_accepted_drafts
            request.draft_num_computed = min(
                request.draft_num_computed, old_num_tokens + num_accepted_drafts
            )
            if item.spec_token_ids:
                request.num_draft_tokens += len(item.spec_token_ids)
                request.num_accepted_tokens += num_accepted_drafts
                request.spec_token_ids = []
                request.draft_probs = None
            # Accepted drafts count as computed before they join the request's tokens: publish
            # (hash) full blocks only once those tokens are appended.
            status = self._append_tokens(request, sampled.get(request.request_id, ()))
            self.kv.cache_computed_blocks(request)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
            elif item.spec_token_ids:
                self.kv.trim(request, request.num_tokens)
        return finished

    def _append_tokens(self, request: Request, token_ids: Sequence[int]) -> RequestStatus | None:
        for token in token_ids:
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                return status
        return None

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        reason = finish_reason(request.sampling_params, token, request.num_output_tokens, request.num_tokens,
                               self.max_model_len, request.eos_token_ids)
        return None if reason is None else _FINISHED_BY[reason]

    def check_integrity(self, parked: Collection[str] = ()) -> None:
        """Raise if a block or a request is accounted for wrongly: each known request sits in
        exactly one queue, but those WAITING_FOR_REMOTE_KVS and the admitted ``parked`` ones
        (the engine's, compiling a grammar), which sit in none; only they and running and
        prefilled requests have block tables; held ids belong to no known request."""
        remote = {r.request_id for r in self.waiting_for_remote_kvs()}
        parked = set(parked) & self.requests.keys()
        self.kv.check_integrity(sorted(remote))
        queued = [r.request_id for r in (*self.waiting, *self.running, *self.prefilled)]
        if len(set(queued)) != len(queued) or set(queued) | remote | parked != set(self.requests) \
                or set(queued) & (remote | parked):
            raise RuntimeError("a request is in no queue, or in more than one")
        with_blocks = set(self.kv.req_to_blocks)
        may_hold = {r.request_id for r in (*self.running, *self.prefilled)} | remote | parked
        if not with_blocks <= may_hold:
            raise RuntimeError(f"blocks held by non-running requests: {sorted(with_blocks - may_hold)}")
        transfer = set(self.kv.held) & set(self.requests)
        if transfer:
            raise RuntimeError(f"held ids that are also known requests: {sorted(transfer)}")
