"""The in-process engine: ``add_request`` / ``step`` / ``abort``, and ``generate`` on top.

A serving loop calls ``step()`` repeatedly; each step schedules one ragged batch, runs one
forward, samples, and returns the requests that advanced. Not thread-safe: one loop owns
an ``Engine``; other threads hand it work through a queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, SampledToken
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.proposers import Proposer, make_proposer
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import make_generator
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


def _load_tokenizer(path: str) -> Any | None:
    root = Path(path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def _eos_token_ids(path: str, spec_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids as ``generate`` uses them: generation_config.json first, then config.json."""
    if (Path(path) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return spec_eos


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
        self.tokenizer = _load_tokenizer(config.model)
        self.eos_token_ids = _eos_token_ids(config.model, self.spec.eos_token_ids)
        self.stats = EngineStats()
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            self.proposer = make_proposer(config.speculative, self.runner)
        self._ids = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}

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

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.spec.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                "leaves no room for output"
            )
        needed = self.kv.blocks_needed(len(token_ids) + 1)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"prompt needs {needed} KV blocks but the pool has {self.kv.num_blocks}"
            )

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Invalid input raises ``ValueError`` and leaves
        the engine untouched."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        token_ids = self.tokenize(prompt)
        if any(t >= self.spec.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.spec.vocab_size}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids)
        request.generator = make_generator(params, self.runner.device)
        self.scheduler.add(request)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now (also blocks held or reserved under the
        id). False if it is not (or no longer) known."""
        self._detok.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs for requests that gained tokens or finished."""
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        if out.is_empty:
            return []
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
        return [
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
        k = spec.num_speculative_tokens
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
        new_token_ids = request.output_token_ids[num_before:]
        detok = self._detok.get(request.request_id)
        new_text = detok.add(new_token_ids) if detok is not None else ""
        finished = request.status.finished
        if finished:
            self._detok.pop(request.request_id, None)
        wants_logprobs = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            new_token_ids=new_token_ids,
            text=detok.text if detok is not None else "",
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.finish_reason,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
            top_logprobs=list(request.output_top_logprobs)
            if wants_logprobs and request.sampling_params.logprobs
            else None,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
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
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]

    def check_integrity(self) -> None:
        """Raise if any KV block is leaked, double-freed or held by a finished request."""
        self.scheduler.check_integrity()

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks
