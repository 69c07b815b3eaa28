"""The in-process engine: ``add_request`` / ``step`` / ``abort``, and ``generate`` on top.

One thread calls ``step()`` repeatedly (in a worker, the engine thread,
``engine/engine_thread.py``); each step schedules one ragged batch, runs one forward,
samples, and returns the requests that advanced. Not thread-safe: one thread owns an
``Engine``; other threads hand it work through a queue.

The KV hand-off between a prefill and a decode worker (hold, pack, release; reserve,
unpack, admit) is the part it holds as ``handoff`` (``engine/kv_handoff.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import structlog

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventLog
from engine.kv_handoff import KVHandoff
from engine.kv_layout import KVLayout
from engine.model_runner import ModelRunner, SampledToken
from engine.models.spec import eos_token_ids, load_tokenizer
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.proposers import Proposer, make_proposer
from engine.outputs import CompletionOutput, EngineLoad, RequestOutput
from engine.prompt_check import check_prompt, check_prompt_len
from engine.request import Request, RequestStatus
from engine.sampler import make_generator, skip_sampled_draws
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured_output import StructuredOutput

log = structlog.get_logger()

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


class Engine(StructuredOutput):
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
        self._init_structured_output(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        if self.grammars is not None:
            self.runner.grammar_stats = self.grammars.stats
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Outputs of requests that finished on admission (admit_prefilled), for step().
        self._early_outputs: list[RequestOutput] = []
        self._preparations: Iterator[str] | None = None  # prepare_some's progress
        # The KV hand-off API (reserve / unpack / admit; hold / pack / release), a part of this engine.
        self.handoff = KVHandoff(self)

    @property
    def kv_layout(self) -> KVLayout:
        """The paged-KV shape both workers must agree on before exchanging pages."""
        return self.runner.kv_layout

    # -- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; raises ``ValueError`` naming ``prompt`` when invalid."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = list(prompt)
        self._validate_prompt(token_ids)
        return token_ids

    def _validate_prompt(self, token_ids: list[int], field: str = "prompt") -> None:
        """The prompt rule (``engine/prompt_check.py``), then the KV pool's size."""
        check_prompt(token_ids, self.spec.vocab_size, self.max_model_len, field)
        self._validate_prompt_len(len(token_ids), field)

    def _validate_prompt_len(self, num_tokens: int, field: str) -> None:
        check_prompt_len(num_tokens, self.max_model_len, field)
        needed = self.kv.blocks_needed(num_tokens + 1)
        if needed > self.kv.num_blocks:
            raise ValueError(f"{field} needs {needed} KV blocks but the pool has {self.kv.num_blocks}")

    def _validate_params(self, params: SamplingParams, field: str = "sampling_params") -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{field} must be a SamplingParams")
        if any(t >= self.spec.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.spec.vocab_size}")

    def _new_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, hold_kv: bool = False,
        num_skipped_draws: int = 0,
    ) -> Request:
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids, hold_kv=hold_kv)
        self._set_params(request, params, num_skipped_draws)
        return request

    def _set_params(self, request: Request, params: SamplingParams, num_skipped_draws: int) -> None:
        """Give ``request`` its sampling params and generator, past ``num_skipped_draws`` draws."""
        request.sampling_params = params
        request.generator = make_generator(params, self.runner.device)
        skip_sampled_draws(params, request.generator, self.spec.vocab_size, num_skipped_draws)

    @staticmethod
    def _validate_prior_draws(num_prior_draws: object, prompt_len: int) -> int:
        if not isinstance(num_prior_draws, int) or isinstance(num_prior_draws, bool) \
                or not 0 <= num_prior_draws < prompt_len:
            raise ValueError(f"num_prior_draws must be an integer in [0, {prompt_len}) "
                             f"(tokens at the end of the prompt), got {num_prior_draws!r}")
        return num_prior_draws

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        hold_kv: bool = False,
        num_prior_draws: int = 0,
    ) -> str:
        """Queue a request; returns its id. Invalid input raises ``ValueError`` and leaves
        the engine untouched.

        ``hold_kv`` (prefill worker): when the request finishes normally its prompt's KV
        blocks are kept, not freed, until ``release_kv`` (or ``abort``); see
        ``held_block_ids``. Its outputs are the usual ones (normally ``max_tokens=1``:
        ``params.for_prefill()``).

        ``num_prior_draws`` (a request migrated mid-stream, whose last prompt tokens were
        generated elsewhere): a seeded request's generator skips that many samples first, so
        it continues the random stream of the run it resumes (< the prompt's length).
        """
        params = params or SamplingParams()
        self._validate_params(params)
        token_ids = self.tokenize(prompt)
        self._validate_prior_draws(num_prior_draws, len(token_ids))
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self._new_request(request_id, token_ids, params, hold_kv, num_prior_draws)
        if not self._defer_until_compiled(request, num_prior_draws, self.scheduler.add):
            self.scheduler.add(request)
        if self.tokenizer is not None and self.config.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now, including blocks held (``hold_kv``) or
        reserved (``reserve_kv``: a request WAITING_FOR_REMOTE_KVS) under the id; no output
        for it comes out of ``step()`` afterwards. False if the id is not (or no longer) known."""
        self._detok.pop(request_id, None)
        pending = self._drop_pending_grammar(request_id)
        num_early = len(self._early_outputs)
        self._early_outputs = [o for o in self._early_outputs if o.request_id != request_id]
        return self.scheduler.abort(request_id) or len(self._early_outputs) < num_early or pending

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or an output is still to be returned.
        Held and reserved blocks do not count: they wait on the caller, not on ``step()``."""
        return self.scheduler.has_unfinished() or bool(self._early_outputs) or bool(self._pending_grammars)

    def prepare_some(self) -> bool:
        """Make one piece of what the model's first calls would make lazily (its packed
        weights: ``LlamaModel.preparations``); False once nothing is left. For an idle engine:
        a packing piece takes milliseconds (the LM head's, a tenth of a second), a timing of
        ``measure_block_rows`` up to ~90 ms (the default model's 120 projections at up to 128
        rows, Zen 5), and the results are the ones the first calls would have made."""
        if self._preparations is None:
            self._preparations = self.runner.model.preparations()
        return next(self._preparations, None) is not None

    def prepare(self) -> None:
        """Make every piece ``prepare_some`` would, now: what an engine used in-process (no
        idle engine thread) runs before its first requests, as a served worker's idle loop
        does after it registers."""
        while self.prepare_some():
            pass

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs for requests that gained tokens or finished
        (first those that finished on admission, see ``admit_prefilled``)."""
        early, self._early_outputs = self._early_outputs, []
        early += self._admit_compiled()
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        if out.is_empty:
            return early
        self._count_tokens(out)
        block_ids = {s.request.request_id: self.kv.block_ids(s.request.request_id) for s in out.scheduled}
        result = self.runner.execute(out, block_ids)
        num_before = {s.request.request_id: s.request.num_output_tokens for s in out.scheduled}
        self._fail(out, result.failed)
        for item in out.scheduled:
            for token in result.tokens.get(item.request.request_id, ()):
                self._record_logprobs(item.request, token)
        sampled = {rid: [t.token_id for t in tokens] for rid, tokens in result.tokens.items()}
        self._advance_grammars(out, sampled)
        self.scheduler.update_after_step(out, sampled, result.num_accepted)
        self._finish_completed_grammars(out)
        self.stats.num_steps += 1
        self._propose()
        return early + [
            self._make_output(s.request, num_before[s.request.request_id], result.failed.get(s.request.request_id))
            for s in out.scheduled
            if s.request.request_id in result.tokens or s.request.request_id in result.failed
        ]

    def _fail(self, out: SchedulerOutput, failed: dict[str, str]) -> None:
        """End the requests the step could give no token (``StepResult.failed``) as
        FINISHED_ERROR: their blocks freed and withdrawn from the prefix cache."""
        for item in out.scheduled:
            reason = failed.get(item.request.request_id)
            if reason is not None and not item.request.status.finished:
                log.error("engine.request_failed", request_id=item.request.request_id, reason=reason)
                self.scheduler.finish(item.request, RequestStatus.FINISHED_ERROR)

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

    def _make_output(self, request: Request, num_before: int, error: str | None = None) -> RequestOutput:
        """What this step added to ``request`` (output tokens from index ``num_before``);
        ``error``: why it failed (FINISHED_ERROR)."""
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
            error=error,
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
        self.scheduler.check_integrity(parked=self._pending_grammars.keys())

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def kv_events(self) -> KVEventLog:
        """What the prefix cache published and evicted (thread-safe; ``engine/kv_events.py``)."""
        return self.kv.pool.events

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
            num_cached_prompt_tokens=self.stats.num_cached_prompt_tokens,
            num_received_prompt_tokens=self.stats.num_received_prompt_tokens,
            num_blocks_in_transfer=self._num_blocks_in_transfer(),
        )

    def _num_blocks_in_transfer(self) -> int:
        """Blocks held for a transfer out (prefill) or owned by requests WAITING_FOR_REMOTE_KVS
        (decode): counted once each, a shared prefix hit included."""
        block_ids = {b.block_id for blocks in self.kv.held.values() for b in blocks}
        for request in self.scheduler.waiting_for_remote_kvs():
            block_ids.update(self.kv.block_ids(request.request_id))
        return len(block_ids)
