"""The in-process engine: ``add_request`` / ``step`` / ``abort``, and ``generate`` on top.

A serving loop calls ``step()`` repeatedly; each step schedules one ragged batch, runs one
forward, samples, and returns the requests that advanced. Not thread-safe: one loop owns
an ``Engine``; other threads hand it work through a queue.

KV transfer hooks (no transport here; the workers move the tensors)::

    prefill worker                                 decode worker
    add_request(p, params.for_prefill(),           reserve_kv(rid, len(p)) -> block ids | None
                rid, hold_kv=True)
    step() ... until rid finishes (first token)
    held_block_ids(rid) -> ids; pack_kv(ids) ----> unpack_kv(rid, packed)
    release_kv(rid)                                admit_prefilled(rid, p, first token, params)
                                                   step() ... streams tokens 2, 3, ...
    abort(rid) frees held blocks                   abort(rid) / cancel_reservation(rid)
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.kv_layout import KVLayout
from engine.model_runner import ModelRunner, SampledToken
from engine.models.spec import eos_token_ids, load_tokenizer
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.proposers import Proposer, make_proposer
from engine.outputs import CompletionOutput, EngineLoad, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import make_generator, skip_sampled_draws
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

Prompt = str | Sequence[int]


@dataclass
class EngineStats:
    """Counters since start (monotonic)."""

    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt tokens run through the model
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_received_prompt_tokens: int = 0  # prompt tokens whose K/V came from another worker


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.spec = self.runner.spec
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.spec)
        self.stats = EngineStats()
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            self.proposer = make_proposer(config.speculative, self.runner)
        self._ids = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Outputs of requests that finished on admission (admit_prefilled), for step().
        self._early_outputs: list[RequestOutput] = []

    # -- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; raises ``ValueError`` naming ``prompt`` when invalid."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = list(prompt)
        self._validate_prompt(token_ids)
        return token_ids

    def _validate_prompt(self, token_ids: list[int], field: str = "prompt") -> None:
        if not token_ids:
            raise ValueError(f"{field} must not be empty")
        vocab = self.spec.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"{field} token ids must be integers in [0, {vocab})")
        self._validate_prompt_len(len(token_ids), field)

    def _validate_prompt_len(self, num_tokens: int, field: str) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"{field} is {num_tokens} tokens; max_model_len={self.max_model_len} "
                "leaves no room for output"
            )
        needed = self.kv.blocks_needed(num_tokens + 1)
        if needed > self.kv.num_blocks:
            raise ValueError(f"{field} needs {needed} KV blocks but the pool has {self.kv.num_blocks}")

    def _validate_params(self, params: SamplingParams, field: str = "sampling_params") -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{field} must be a SamplingParams")
        if any(t >= self.spec.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.spec.vocab_size}")

    def _new_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, hold_kv: bool = False
    ) -> Request:
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids, hold_kv=hold_kv)
        request.generator = make_generator(params, self.runner.device)
        return request

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        hold_kv: bool = False,
    ) -> str:
        """Queue a request; returns its id. Invalid input raises ``ValueError`` and leaves
        the engine untouched.

        ``hold_kv`` (prefill worker): when the request finishes normally its prompt's KV
        blocks are kept, not freed, until ``release_kv`` (or ``abort``); see
        ``held_block_ids``. Its outputs are the usual ones (normally ``max_tokens=1``:
        ``params.for_prefill()``).
        """
        params = params or SamplingParams()
        self._validate_params(params)
        token_ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self._new_request(request_id, token_ids, params, hold_kv)
        self.scheduler.add(request)
        if self.tokenizer is not None and self.config.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now, including blocks held (``hold_kv``) or
        reserved (``reserve_kv``) under the id; no output for it comes out of ``step()``
        afterwards. False if the id is not (or no longer) known."""
        self._detok.pop(request_id, None)
        num_early = len(self._early_outputs)
        self._early_outputs = [o for o in self._early_outputs if o.request_id != request_id]
        return self.scheduler.abort(request_id) or len(self._early_outputs) < num_early

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or an output is still to be returned.
        Held and reserved blocks do not count: they wait on the caller, not on ``step()``."""
        return self.scheduler.has_unfinished() or bool(self._early_outputs)

    # -- KV transfer: prefill worker -------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks holding a finished ``hold_kv`` request's prompt K/V, in token order:
        ``ceil(num_prompt_tokens / block_size)`` ids (the sampled first token has no K/V
        here; the decode worker computes it). ValueError if nothing is held under the id."""
        return self.kv.held_block_ids(request_id)

    def pack_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy of pages ``block_ids`` of every layer,
        ``kv_layout.packed_shape(len(block_ids))`` = ``[L, 2, n, block_size, kv_heads,
        head_dim]``. Being a copy, it stays valid after ``release_kv`` (on CUDA: for work
        queued later on the same stream)."""
        return self.runner.pack_kv(self._check_block_ids(block_ids, distinct=False))

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks held under ``request_id`` (once). False if none are held."""
        return self.kv.release(request_id)

    # -- KV transfer: decode worker --------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        """The paged-KV shape both workers must agree on before exchanging pages."""
        return self.runner.kv_layout

    def reserve_kv(self, request_id: str, num_prompt_tokens: int) -> list[int] | None:
        """Take ``ceil(num_prompt_tokens / block_size)`` fresh blocks for a sequence whose
        prompt K/V will arrive (``unpack_kv``); then ``admit_prefilled`` or
        ``cancel_reservation``. Returns the block ids, or None when the pool cannot supply
        them now (retry after blocks are freed). Reserving takes free blocks, evicting only
        unreferenced cached ones: it never preempts and never touches a block a request
        holds. Reserved blocks count as used in ``num_free_blocks``.

        ValueError if the sequence could never run here (``num_prompt_tokens`` < 1, >=
        ``max_model_len``, or with its first output token more blocks than the pool) or the
        id is in use (queued, running, held or reserved)."""
        if not _is_int(num_prompt_tokens) or num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be an integer >= 1, got {num_prompt_tokens!r}")
        self._validate_prompt_len(num_prompt_tokens, "num_prompt_tokens")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if self.scheduler.is_known(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.kv.reserve(request_id, num_prompt_tokens)

    def unpack_kv(self, request_id: str, packed: torch.Tensor) -> None:
        """Write page i of ``packed`` (``kv_layout.packed_shape(n)``, the cache dtype;
        another device is copied over) into block i of the reservation under
        ``request_id``, so pages can only land in the reservation they were sent for, never
        in a block a request or the prefix cache relies on. ValueError when nothing is
        reserved under the id, or on a shape or dtype mismatch.

        Thread-safe against the engine's own thread while the caller guarantees that the
        reservation is neither cancelled nor admitted meanwhile (the decode worker holds the
        lock that freeing takes): the reservation's block list never changes, and only this
        call writes its blocks."""
        reservation = self.kv.reserved.get(request_id)
        if reservation is None:
            raise ValueError(f"request_id {request_id!r} has no reservation to unpack into")
        self.runner.unpack_kv([block.block_id for block in reservation.blocks], packed)

    def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        first_logprob: float | None = None,
        first_top_logprobs: dict[int, float] | None = None,
    ) -> None:
        """Turn the reservation under ``request_id`` (its pages already unpacked) into a
        request whose prompt K/V are computed and whose output holds ``first_token_id``.
        The next steps compute the first token's K/V and sample token 2 onwards.

        * Outputs: ``new_token_ids`` / ``new_text`` of step() outputs only ever hold later
          tokens (the first was streamed by the prefill leg); ``num_output_tokens`` counts
          the first token too.
        * If ``first_token_id`` already finishes the request (EOS, a stop token,
          ``max_tokens == 1``, ``max_model_len``), its blocks are freed at once and the next
          ``step()`` returns its final output (``finished``, empty ``new_token_ids``).
        * Seeded sampling: the request's generator skips the draw the prefill worker made for
          the first token, so its tokens equal an in-process run's (without speculation).
        * Prefix caching: the received full prompt blocks are published in this worker's
          prefix cache (a block whose hash is already published stays private, unshared).
        * With ``params.logprobs`` set, ``first_logprob`` (and, for top-n, the prefill
          worker's ``first_top_logprobs``) are required: the request's logprob history
          starts with the first token's.

        Validates like ``add_request`` (ValueError naming the field); on ValueError the
        reservation is untouched, so the caller can still cancel it. ``prompt_token_ids``
        must have exactly the reserved length.
        """
        num_reserved = self.kv.reserved_num_tokens(request_id)
        if num_reserved is None:
            raise ValueError(f"request_id {request_id!r} has no reservation (reserve_kv first)")
        token_ids = list(prompt_token_ids)
        self._validate_prompt(token_ids, "prompt_token_ids")
        if len(token_ids) != num_reserved:
            raise ValueError(
                f"prompt_token_ids has {len(token_ids)} tokens; the reservation is for {num_reserved}"
            )
        self._validate_params(params, "params")
        vocab = self.spec.vocab_size
        if not _is_int(first_token_id) or not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id must be an integer in [0, {vocab}), got {first_token_id!r}")
        first = self._first_token(params, first_token_id, first_logprob, first_top_logprobs)
        request = self._new_request(request_id, token_ids, params)
        skip_sampled_draws(params, request.generator, vocab)
        request.append_output_token(first_token_id)
        self._record_logprobs(request, first)
        request.num_computed_tokens = len(token_ids)
        self.stats.num_received_prompt_tokens += len(token_ids)
        if self.tokenizer is not None and self.config.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids)
            detok.add([first_token_id])
            self._detok[request_id] = detok
        if not self.scheduler.add_prefilled(request):
            self._early_outputs.append(self._make_output(request, num_before=1))

    @staticmethod
    def _first_token(
        params: SamplingParams, token_id: int, logprob: float | None, top_logprobs: dict[int, float] | None
    ) -> SampledToken:
        if params.logprobs is None:
            return SampledToken(token_id)
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise ValueError("first_logprob (a float) is required when params.logprobs is set")
        if params.logprobs == 0:
            return SampledToken(token_id, float(logprob))
        if not isinstance(top_logprobs, dict):
            raise ValueError("first_top_logprobs (token id -> logprob) is required when params.logprobs > 0")
        return SampledToken(token_id, float(logprob), dict(top_logprobs))

    def cancel_reservation(self, request_id: str) -> bool:
        """Free a reservation's blocks (once). False if there is no reservation under the id."""
        return self.kv.cancel_reservation(request_id)

    def _check_block_ids(self, block_ids: Sequence[int], distinct: bool) -> list[int]:
        num_blocks = self.kv.num_blocks
        try:
            ids = [operator.index(b) for b in block_ids]
        except TypeError:
            ids = [-1]
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"block_ids must be integers in [0, {num_blocks})")
        if distinct and len(set(ids)) != len(ids):
            raise ValueError("block_ids must be distinct")
        return ids

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs for requests that gained tokens or finished
        (first those that finished on admission, see ``admit_prefilled``)."""
        early, self._early_outputs = self._early_outputs, []
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        if out.is_empty:
            return early
        self._count_tokens(out)
        block_ids = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in out.scheduled}
        result = self.runner.execute(out, block_ids)
        num_before = {s.request.request_id: s.request.num_output_tokens for s in out.scheduled}
        for item in out.scheduled:
            for token in result.tokens.get(item.request.request_id, ()):
                self._record_logprobs(item.request, token)
        self.scheduler.update_after_step(
            out,
            {rid: [t.token_id for t in tokens] for rid, tokens in result.tokens.items()},
            result.num_accepted,
        )
        self.stats.num_steps += 1
        self._propose()
        return early + [
            self._make_output(s.request, num_before[s.request.request_id])
            for s in out.scheduled
            if s.request.request_id in result.tokens
        ]

    # -- speculative decoding --------------------------------------------------------
    def _num_speculative_tokens(self, request: Request) -> int:
        """Drafts worth proposing for a decoding request (0: do not speculate)."""
        spec = self.config.speculative
        params = request.sampling_params
        if spec is None or params.repetition_penalty != 1.0 or params.logprobs is not None:
            return 0  # history-dependent penalties and logprobs: one token per step
        if request.num_output_tokens < params.min_tokens:
            return 0
        k = spec.max_num_drafts
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        remaining = params.max_tokens - request.num_output_tokens - 1
        return max(0, min(k, remaining, self.max_model_len - request.num_tokens))

    def _propose(self) -> None:
        """Propose drafts for the next step (back off when the batch is large)."""
        spec = self.config.speculative
        if self.proposer is None or spec is None or len(self.scheduler.running) > spec.max_batch_size:
            return
        requests, ks = [], []
        for request in self.scheduler.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            k = self._num_speculative_tokens(request)
            # Reserve the lookahead slots the drafts and their verification will write.
            if k > 0 and self.kv.allocate_slots(request, 1 + k):
                requests.append(request)
                ks.append(k)
        if requests:
            block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r in requests}
            self.proposer.propose(requests, ks, block_ids)

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.runner.spec_stats

    def _count_tokens(self, out: SchedulerOutput) -> None:
        self.stats.num_cached_prompt_tokens += out.num_cached_tokens
        for item in out.scheduled:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            num_prompt = max(0, min(end, item.request.num_prompt_tokens) - start)
            self.stats.num_prefill_tokens += num_prompt
            self.stats.num_decode_tokens += item.num_new_tokens - num_prompt

    @staticmethod
    def _record_logprobs(request: Request, token: SampledToken) -> None:
        if token.logprob is not None:
            request.output_logprobs.append(token.logprob)
        if token.top_logprobs is not None:
            request.output_top_logprobs.append(token.top_logprobs)

    def _make_output(self, request: Request, num_before: int) -> RequestOutput:
        """What this step added to ``request`` (output tokens from index ``num_before``)."""
        new_token_ids = request.output_token_ids[num_before:]
        detok = self._detok.get(request.request_id)
        new_text = detok.add(new_token_ids) if detok is not None else ""
        finished = request.status.finished
        if finished:
            self._detok.pop(request.request_id, None)
        num_logprobs = request.sampling_params.logprobs
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=request.output_logprobs[num_before:] if num_logprobs is not None else None,
            new_top_logprobs=request.output_top_logprobs[num_before:] if num_logprobs else None,
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.finish_reason,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run prompts to completion; outputs in prompt order. All prompts are validated
        before any is queued."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError("params: need one SamplingParams per prompt")
        token_lists = [self.tokenize(p) for p in prompt_list]
        ids = [self.add_request(t, p) for t, p in zip(token_lists, param_list)]
        done = {i: CompletionOutput(i, t) for i, t in zip(ids, token_lists)}
        num_finished = 0
        while num_finished < len(ids) and self.has_unfinished_requests():
            for output in self.step():
                completion = done.get(output.request_id)
                if completion is not None:
                    completion.add(output)
                    num_finished += output.finished
        return [done[i] for i in ids]

    def check_integrity(self) -> None:
        """Raise if any KV block is leaked, double-freed or held by a finished request."""
        self.scheduler.check_integrity()

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def load(self) -> EngineLoad:
        """A snapshot of queues, pool and speculation counters (call on the owning thread)."""
        sched = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        spec = None
        if self.proposer is not None:
            stats = self.spec_stats
            spec = replace(stats, accepted_per_position=list(stats.accepted_per_position))
        return EngineLoad(
            num_blocks_total=self.kv.num_blocks, num_blocks_free=self.kv.num_free_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_queued_prefill_tokens=queued, spec=spec,
        )
