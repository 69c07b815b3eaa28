"""The engine's KV hand-off API, for disaggregated prefill/decode (the workers move the
tensors; nothing here touches a network)::

    prefill worker                                 decode worker
    add_request(p, params.for_prefill(),           reserve_kv(rid, len(p), p) -> block ids | None
                rid, hold_kv=True)                 reserved_num_cached_blocks(rid) -> k (prefix hits)
    step() ... until rid finishes (first token)    (rid: WAITING_FOR_REMOTE_KVS)
    held_block_ids(rid)[k:] -> ids;
    pack_kv(ids), or in chunks   ---------------> unpack_kv(rid, packed, first_page)
    release_kv(rid)                                admit_prefilled(rid, p, first token, params)
                                                   (rid: WAITING in ``prefilled``, then RUNNING)
                                                   step() ... streams tokens 2, 3, ...
    abort(rid) frees held blocks                   abort(rid) / free_reserved_kv(rid)

``KVHandoff`` is a part the engine holds (``engine.handoff``), called on the engine's owner
thread like the engine itself (``pack_kv`` and ``unpack_kv`` aside, as they say). It reaches
the engine only through ``HandoffHost``: the KV cache manager, the runner, the scheduler and
the engine's request validation and output making, so this module does not import the
engine's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.model_runner import SampledToken
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.detokenizer import IncrementalDetokenizer



class HandoffHost(Protocol):
    """What the hand-off uses of the engine that holds it (``engine/engine.py``'s ``Engine``)."""

    kv: Any  # engine.kv_cache_manager.KVCacheManager
    runner: Any  # engine.model_runner.ModelRunner
    scheduler: Any  # engine.scheduler.Scheduler
    spec: Any  # the model's ModelSpec
    config: Any  # EngineConfig
    tokenizer: Any
    stats: Any  # EngineStats
    _detok: dict[str, IncrementalDetokenizer]
    _early_outputs: list[Any]

    def _validate_prompt(self, token_ids: list[int], field: str = "prompt") -> None: ...
    def _validate_prompt_len(self, num_tokens: int, field: str) -> None: ...
    def _validate_params(self, params: SamplingParams, field: str = "sampling_params") -> None: ...
    def _validate_prior_draws(self, num_prior_draws: object, prompt_len: int) -> int: ...
    def _new_request(self, request_id: str, token_ids: list[int], params: SamplingParams, hold_kv: bool = False,
                     num_skipped_draws: int = 0) -> Request: ...
    def _set_params(self, request: Request, params: SamplingParams, num_skipped_draws: int) -> None: ...
    def _record_logprobs(self, request: Request, token: SampledToken) -> None: ...
    def _make_output(self, request: Request, num_before: int) -> Any: ...
    def _defer_until_compiled(self, request: Request, num_prior: int, admit: Any) -> bool: ...


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class KVHandoff:
    """Hold, pack and release a prompt's pages (prefill side); reserve, unpack and admit
    them (decode side)."""

    def __init__(self, host: HandoffHost) -> None:
        self._host = host

    # -- KV transfer: prefill worker -------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks holding a finished ``hold_kv`` request's prompt K/V, in token order:
        ``ceil(num_prompt_tokens / block_size)`` ids (the sampled first token has no K/V
        here; the decode worker computes it). ValueError if nothing is held under the id."""
        return self._host.kv.held_block_ids(request_id)

    def pack_kv(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of pages ``block_ids`` of every layer,
        ``kv_layout.packed_shape(len(block_ids))`` = ``[L, 2, n, block_size, kv_heads,
        head_dim]``, into ``out`` when given (a reused staging buffer of that shape; ValueError
        otherwise). Being a copy, it stays valid after ``release_kv`` (on CUDA: for work
        queued later on the same stream). Reads only the given blocks: another thread may
        call it for blocks held under ``hold_kv`` while the engine steps."""
        return self._host.runner.pack_kv(self._check_block_ids(block_ids, distinct=False), out)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks held under ``request_id`` (once). False if none are held."""
        return self._host.kv.release(request_id)

    # -- KV transfer: decode worker --------------------------------------------------------
    def reserve_kv(self, request_id: str, num_prompt_tokens: int,
                   prompt_token_ids: Sequence[int]) -> list[int] | None:
        """Make ``request_id`` a request WAITING_FOR_REMOTE_KVS that owns
        ``ceil(num_prompt_tokens / block_size)`` blocks for its prompt ``prompt_token_ids``
        (``num_prompt_tokens`` of them), whose K/V will arrive (``unpack_kv``); then
        ``admit_prefilled`` or ``free_reserved_kv`` (or ``abort``). The leading blocks this
        worker's prefix cache already holds are taken as hits
        (``reserved_num_cached_blocks``; at least the last block is always fresh), and only
        the rest need pages. Its sampling params come at admission. Returns the block ids, or None when the pool cannot supply them
        now (retry after blocks are freed). Reserving takes free blocks, evicting only
        unreferenced cached ones: it never preempts and never touches a block a request
        holds. Reserved blocks count as used in ``num_free_blocks``.

        ValueError if the sequence could never run here (``num_prompt_tokens`` < 1, >=
        ``max_model_len``, or with its first output token more blocks than the pool), the
        token ids are not ``num_prompt_tokens`` valid ids, or the id is in use (queued,
        running, held or reserved)."""
        if not is_int(num_prompt_tokens) or num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be an integer >= 1, got {num_prompt_tokens!r}")
        self._host._validate_prompt_len(num_prompt_tokens, "num_prompt_tokens")
        token_ids = list(prompt_token_ids)
        self._host._validate_prompt(token_ids, "prompt_token_ids")
        if len(token_ids) != num_prompt_tokens:
            raise ValueError(f"prompt_token_ids has {len(token_ids)} tokens, num_prompt_tokens is {num_prompt_tokens}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if self._host.scheduler.is_known(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._host.scheduler.reserve(self._host._new_request(request_id, token_ids, SamplingParams()))

    def _waiting(self, request_id: str) -> Request | None:
        """The request under ``request_id`` if it is WAITING_FOR_REMOTE_KVS (any thread: one
        dict read)."""
        request = self._host.scheduler.requests.get(request_id)
        return request if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS else None

    def reserved_num_cached_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request WAITING_FOR_REMOTE_KVS under ``request_id``
        are prefix-cache hits (their pages need not travel). ValueError if there is none."""
        request = self._waiting(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV")
        return request.num_cached_tokens // self._host.kv.block_size

    def unpack_kv(self, request_id: str, packed: torch.Tensor, first_page: int = 0) -> None:
        """Write page i of ``packed`` (``kv_layout.packed_shape(n)``, the cache dtype;
        another device is copied over) into fresh block ``first_page + i`` of the
        blocks of the request WAITING_FOR_REMOTE_KVS under ``request_id`` (its blocks after
        the prefix-cache hits), so pages can only land in the reservation they were sent
        for, never in a block a request or the prefix cache relies on. ValueError when no
        request under the id waits for remote KV, the pages overrun the fresh blocks, or on a
        shape or dtype mismatch.

        Thread-safe against the engine's own thread while the caller guarantees that the
        request is neither freed nor admitted meanwhile (the decode worker holds the lock
        that freeing and admission take): its block list never changes, and only this call
        writes its fresh blocks."""
        if self._waiting(request_id) is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV: no blocks to unpack into")
        fresh = self._host.kv.fresh_block_ids(request_id)
        num_pages = packed.shape[2] if isinstance(packed, torch.Tensor) and packed.dim() == 6 else -1
        if not is_int(first_page) or first_page < 0 or num_pages < 0 or first_page + num_pages > len(fresh):
            raise ValueError(f"packed pages [{first_page}, {first_page} + {num_pages}) must lie within the "
                             f"request's {len(fresh)} reserved fresh blocks")
        self._host.runner.unpack_kv(fresh[first_page:first_page + num_pages], packed)

    def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        first_logprob: float | None = None,
        first_top_logprobs: dict[int, float] | None = None,
        num_prior_draws: int = 0,
    ) -> None:
        """Admit the request WAITING_FOR_REMOTE_KVS under ``request_id`` (its pages already
        unpacked): its prompt K/V are computed, its output holds ``first_token_id``, and it
        waits (WAITING) in the scheduler's ``prefilled`` queue, which the next step moves into
        the running batch (RUNNING). That step computes the first token's K/V and samples
        token 2 onwards.

        * Outputs: ``new_token_ids`` / ``new_text`` of step() outputs only ever hold later
          tokens (the first was streamed by the prefill leg); ``num_output_tokens`` counts
          the first token too.
        * If ``first_token_id`` already finishes the request (EOS, a stop token,
          ``max_tokens == 1``, ``max_model_len``), its blocks are freed at once and the next
          ``step()`` returns its final output (``finished``, empty ``new_token_ids``).
        * Seeded sampling: the request's generator skips the draw the prefill worker made for
          the first token, so its tokens equal an in-process run's (without speculation);
          plus ``num_prior_draws`` for a migrated request (see ``add_request``).
        * Prefix caching: the received full prompt blocks are published in this worker's
          prefix cache (a block whose hash is already published stays private, unshared);
          the reserved prefix-cache hits count as cached prompt tokens (``num_cached_tokens``).
        * With ``params.logprobs`` set, ``first_logprob`` (and, for top-n, the prefill
          worker's ``first_top_logprobs``) are required: the request's logprob history
          starts with the first token's.

        Validates like ``add_request`` (ValueError naming the field); on ValueError the
        request is untouched (still WAITING_FOR_REMOTE_KVS), so the caller can still cancel it.
        ``prompt_token_ids`` must be the reserved prompt.
        """
        request, token_ids = self._reserved_prompt(request_id, prompt_token_ids)
        self._host._validate_params(params, "params")
        vocab = self._host.spec.vocab_size
        if not is_int(first_token_id) or not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id must be an integer in [0, {vocab}), got {first_token_id!r}")
        self._host._validate_prior_draws(num_prior_draws, len(token_ids))
        first = self._first_token(params, first_token_id, first_logprob, first_top_logprobs)
        self._host._set_params(request, params, num_skipped_draws=1 + num_prior_draws)
        request.append_output_token(first_token_id)
        self._host._record_logprobs(request, first)
        request.num_computed_tokens = len(token_ids)
        if self._host.tokenizer is not None and self._host.config.detokenize:
            detok = IncrementalDetokenizer(self._host.tokenizer, token_ids)
            detok.add([first_token_id])
            self._host._detok[request_id] = detok
        # A constrained request joins once its grammar is compiled (engine/structured_output.py).
        if not self._host._defer_until_compiled(request, num_prior_draws, self._add_prefilled):
            self._add_prefilled(request)

    def _add_prefilled(self, request: Request) -> None:
        self._host.stats.num_cached_prompt_tokens += request.num_cached_tokens
        self._host.stats.num_received_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
        if not self._host.scheduler.add_prefilled(request):
            self._host._early_outputs.append(self._host._make_output(request, num_before=1))

    def _reserved_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> tuple[Request, list[int]]:
        """The request WAITING_FOR_REMOTE_KVS under ``request_id`` and ``prompt_token_ids``
        as a list, checked to be its prompt."""
        request = self._waiting(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV (reserve_kv first)")
        token_ids = list(prompt_token_ids)
        self._host._validate_prompt(token_ids, "prompt_token_ids")
        if len(token_ids) != request.num_prompt_tokens:
            raise ValueError(f"prompt_token_ids has {len(token_ids)} tokens; the blocks are reserved for "
                             f"{request.num_prompt_tokens}")
        if token_ids != request.prompt_token_ids:
            raise ValueError("prompt_token_ids differ from the reserved prompt")
        return request, token_ids

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

    def free_reserved_kv(self, request_id: str) -> bool:
        """Free the blocks of the request WAITING_FOR_REMOTE_KVS under ``request_id`` (once;
        it ends FINISHED_ABORTED). False if no request under the id waits for remote KV."""
        return self._waiting(request_id) is not None and self._host.scheduler.abort(request_id)

    def _check_block_ids(self, block_ids: Sequence[int], distinct: bool) -> list[int]:
        num_blocks = self._host.kv.num_blocks
        try:
            ids = [operator.index(b) for b in block_ids]
        except TypeError:
            ids = [-1]
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"block_ids must be integers in [0, {num_blocks})")
        if distinct and len(set(ids)) != len(ids):
            raise ValueError("block_ids must be distinct")
        return ids
