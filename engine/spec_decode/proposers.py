"""Draft proposers: where speculative tokens come from.

A proposer fills ``request.spec_token_ids`` (and ``request.draft_probs``, the distribution
each draft was drawn from, or None for deterministic drafts) for the requests the engine
chose to speculate this step. The target verifies them in the next step's forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.model_runner import ModelRunner, SeqSlice, make_forward_batch
from engine.models.llama import LlamaModel
from engine.models.loader import load_hf_config, load_weights
from engine.models.spec import load_model_spec
from engine.request import Request
from engine.sampler import SamplingMetadata, compute_probs, greedy_tokens, random_sample
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram
from splitserve_kernels import ops
from splitserve_kernels.kv_cache import new_kv_cache


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request], ks: list[int], block_ids: dict[str, list[int]]) -> None:
        """Set up to ``ks[i]`` drafts on ``requests[i]`` (mutates the requests). The KV slots
        for positions up to ``num_tokens + k`` are already allocated in ``block_ids``."""


class NgramProposer(Proposer):
    """Prompt lookup (``propose_ngram``), copying on over its own proposal where the match
    runs into the end of the sequence (``repeat``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.min_ngram_len
        self.max_n = config.ngram_max

    def propose(self, requests: list[Request], ks: list[int], block_ids: dict[str, list[int]]) -> None:
        for request, k in zip(requests, ks):
            request.spec_token_ids = propose_ngram(
                request.all_token_ids, k, self.min_n, self.max_n, repeat=True
            )
            request.draft_probs = None


class DraftModelProposer(Proposer):
    """A smaller checkpoint with the target's tokenizer, run by the same model code.

    Its KV cache mirrors the target's block layout (same block ids, its own tensor), so it
    needs no block manager of its own: a block id the target owns is the draft's too. Each
    proposal first catches the draft up on the tokens it has not seen (the prompt on the
    first call, then the tokens accepted or resampled in the last verify), then runs k - 1
    single-token steps, all batched across requests.

    A single request (batch-1 decode, where a draft forward costs mostly fixed per-call
    overhead) takes ``LlamaModel.forward_sequence`` instead: no ``ForwardBatch`` or
    sampling metadata per draft step, and greedy drafts are plain argmaxes without
    ``draft_probs`` (the verifier ignores a greedy row's draft distribution anyway).
    """

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        assert config.draft_model is not None
        hf_config = load_hf_config(config.draft_model)
        spec = load_model_spec(config.draft_model)
        if spec.vocab_size != target.spec.vocab_size:
            raise ValueError(
                f"draft_model: vocab size {spec.vocab_size} differs from the target's "
                f"{target.spec.vocab_size}; the draft must share the target's tokenizer"
            )
        if spec.max_position_embeddings < target.max_model_len:
            raise ValueError(
                f"draft_model: max_position_embeddings {spec.max_position_embeddings} is below "
                f"max_model_len {target.max_model_len}"
            )
        weights = load_weights(config.draft_model, target.dtype)
        self.device = target.device
        self.block_size = target.block_size
        self.model = LlamaModel(spec, hf_config, weights, target.max_model_len, target.device)
        self.kv_cache = new_kv_cache(
            spec.num_layers, target.num_kv_blocks, target.block_size, spec.num_kv_heads,
            spec.head_dim, target.dtype, target.device,
        )

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int], block_ids: dict[str, list[int]]) -> None:
        with _one_intra_op_thread():
            if len(requests) == 1:
                self._propose_one(requests[0], ks[0], block_ids[requests[0].request_id])
            else:
                self._propose_batch(requests, ks, block_ids)

    def _propose_one(self, request: Request, k: int, block_ids: list[int]) -> None:
        """One request (batch-1 decode): the model's lean single-sequence forward, no
        ``ForwardBatch``; greedy drafts are argmaxes and carry no ``draft_probs``."""
        params = request.sampling_params
        start = request.draft_num_computed
        logits = self.model.forward_sequence(request.all_token_ids[start:], start, block_ids, self.kv_cache)
        metadata = None
        if not params.greedy:
            metadata = SamplingMetadata.build([params], [request.all_token_ids], [request.generator], self.device)
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if j > 0:  # run the previous draft at its position, num_tokens - 1 + j
                logits = self.model.forward_sequence(
                    drafts[-1:], request.num_tokens - 1 + j, block_ids, self.kv_cache
                )
            if metadata is None:
                drafts.append(int(greedy_tokens(logits)))
            else:
                row_probs = compute_probs(logits.unsqueeze(0), metadata)  # [1, vocab]
                drafts.append(int(random_sample(row_probs, metadata.generators)[0]))
                probs.append(row_probs[0])
        _set_drafts(request, drafts, torch.stack(probs) if probs else None)
        request.draft_num_computed = request.num_tokens + k - 1

    def _propose_batch(self, requests: list[Request], ks: list[int], block_ids: dict[str, list[int]]) -> None:
        metadata = SamplingMetadata.build(
            [r.sampling_params for r in requests],
            [r.all_token_ids for r in requests],
            [r.generator for r in requests],
            self.device,
        )
        # Catch up: every token the draft has not run yet, last row gives draft 1.
        slices = [
            SeqSlice(r.all_token_ids[r.draft_num_computed :], r.draft_num_computed, block_ids[r.request_id])
            for r in requests
        ]
        rows, offset = [], 0
        for piece in slices:
            offset += len(piece.token_ids)
            rows.append(offset - 1)
        drafts, probs = self._draw(make_forward_batch(slices, rows, self.block_size, self.device), metadata, requests)
        all_drafts, all_probs = [drafts], [probs]
        for j in range(1, max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            slices = [
                SeqSlice([int(all_drafts[-1][i])], requests[i].num_tokens - 1 + j, block_ids[requests[i].request_id])
                for i in active
            ]
            batch = make_forward_batch(slices, list(range(len(active))), self.block_size, self.device)
            sub = _select_rows(metadata, active, requests)
            step_drafts, step_probs = self._draw(batch, sub, [requests[i] for i in active])
            full_drafts = all_drafts[-1].clone()
            full_probs = all_probs[-1].clone()
            full_drafts[active] = step_drafts
            full_probs[active] = step_probs
            all_drafts.append(full_drafts)
            all_probs.append(full_probs)
        draft_ids = torch.stack(all_drafts, dim=1)  # [num_requests, max_k]
        draft_probs = torch.stack(all_probs, dim=1)  # [num_requests, max_k, vocab]
        for i, (request, k) in enumerate(zip(requests, ks)):
            _set_drafts(request, draft_ids[i, :k].tolist(), draft_probs[i, :k])
            request.draft_num_computed = request.num_tokens + k - 1

    def _draw(
        self, batch: object, metadata: SamplingMetadata, requests: list[Request]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.forward(batch, self.kv_cache)  # type: ignore[arg-type]
        probs = compute_probs(logits, metadata)
        generators = [None if r.sampling_params.greedy else r.generator for r in requests]
        return random_sample(probs, generators), probs


def _set_drafts(request: Request, drafts: list[int], probs: torch.Tensor | None) -> None:
    """Give ``request`` its drafts, cut before the first one drawn from a distribution that is
    not all finite (the draft model's logits were not): rejection sampling divides by those
    probabilities. Argmax drafts (no ``probs``) need no cut: the target's own argmax decides."""
    if probs is not None:
        keep = int(ops.finite_rows(probs).cumprod(0).sum())
        drafts, probs = drafts[:keep], (probs[:keep] if keep else None)
    request.spec_token_ids = drafts
    request.draft_probs = probs


@contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then restore the engine's count.

    A draft forward is ~180 ops on a few hundred numbers each; with more threads, the ops
    that parallelise regardless of size (SDPA, index ops) pay an OpenMP fork/join each,
    which costs more than the op (a batch-1 draft forward took ~1.0 ms with 2 threads,
    ~0.6 ms with 1, on an idle 2-core machine). The target keeps its threads. Setting the
    count costs well under a microsecond; the engine thread is the only caller.
    """
    num_threads = torch.get_num_threads()
    if num_threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _select_rows(metadata: SamplingMetadata, rows: list[int], requests: list[Request]) -> SamplingMetadata:
    if len(rows) == len(requests):
        return metadata
    return SamplingMetadata.build(
        [requests[i].sampling_params for i in rows],
        [requests[i].all_token_ids for i in rows],
        [requests[i].generator for i in rows],
        metadata.temperature.device,
    )


class NgramDraftProposer(Proposer):
    """Prompt lookup where the context repeats, the draft model everywhere else.

    A request whose suffix of at least ``ngram_min`` tokens recurs takes the lookup's
    drafts (free, deterministic: ``draft_probs`` None), up to ``lookup_len`` of them; the
    others go to the draft model in one batch, up to ``num_speculative_tokens`` each. The
    draft's KV simply falls behind while lookup serves a request: its next draft-model
    proposal catches up on every token since (one forward of a few tokens).
    Sampling stays exact per row, whichever proposer drafted it (the verifier treats a
    lookup draft as probability 1 on its token).
    """

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        self.ngram = NgramProposer(config)
        self.draft = DraftModelProposer(config, target)
        self.max_draft_len = config.num_speculative_tokens

    def propose(self, requests: list[Request], ks: list[int], block_ids: dict[str, list[int]]) -> None:
        self.ngram.propose(requests, ks, block_ids)
        rest = [(r, min(k, self.max_draft_len)) for r, k in zip(requests, ks) if not r.spec_token_ids]
        if rest:
            self.draft.propose([r for r, _ in rest], [k for _, k in rest], block_ids)


def make_proposer(config: SpeculativeConfig, target: ModelRunner) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "ngram_draft":
        return NgramDraftProposer(config, target)
    return DraftModelProposer(config, target)
