"""The only component that touches the device: builds step inputs, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.llama import ForwardBatch, LlamaModel
from engine.models.loader import ModelSpec, load_hf_config, load_weights, model_spec_from_config
from engine.request import Request
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler import SchedulerOutput

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window is not None:
        # Sliding-window attention is not implemented: stay inside the window, where
        # full attention is exact.
        limit = min(limit, spec.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.hf_config = load_hf_config(config.model)
        self.spec = model_spec_from_config(self.hf_config)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        weights = load_weights(config.model, self.dtype)
        self.model = LlamaModel(self.spec, self.hf_config, weights, self.max_model_len, self.device)
        self.block_size = config.block_size
        self.num_kv_blocks = config.resolve_num_kv_blocks(
            self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim
        )
        self.kv_cache = torch.zeros(
            self.spec.num_layers,
            2,
            self.num_kv_blocks,
            self.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler = Sampler()

    # -- inputs ------------------------------------------------------------------------
    def prepare_batch(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]]
    ) -> tuple[ForwardBatch, list[Request]]:
        """Flatten the scheduled requests; also return those that sample, in logits order."""
        token_ids: list[int] = []
        positions: list[int] = []
        seq_of_token: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        logits_indices: list[int] = []
        sampling: list[Request] = []
        for s, item in enumerate(out.scheduled):
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            seq_of_token.extend([s] * item.num_new_tokens)
            seq_lens.append(end)
            query_start.append(query_start[-1] + item.num_new_tokens)
            if item.samples:
                logits_indices.append(query_start[-1] - 1)
                sampling.append(request)
        tables = [block_ids[item.request.request_id] for item in out.scheduled]
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        )
        pos = torch.tensor(positions, dtype=torch.int64)
        seq_idx = torch.tensor(seq_of_token, dtype=torch.int64)
        bs = self.block_size
        slots = block_tables[seq_idx, pos // bs].to(torch.int64) * bs + pos % bs
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=pos.to(dev),
            slot_mapping=slots.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )
        return batch, sampling

    # -- step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> dict[str, SampledToken]:
        """Run one step; return the sampled token of every request that reached its end."""
        batch, sampling = self.prepare_batch(out, block_ids)
        logits = self.model.forward(batch, self.kv_cache)
        if not sampling:
            return {}
        self._suppress_stop_tokens(logits, sampling)
        metadata = SamplingMetadata.build(
            [r.sampling_params for r in sampling],
            [r.all_token_ids for r in sampling],
            [r.generator for r in sampling],
            self.device,
        )
        result = self.sampler(logits, metadata)
        return self._collect(sampling, result)

    def _suppress_stop_tokens(self, logits: torch.Tensor, sampling: list[Request]) -> None:
        """Below ``min_tokens``, EOS and stop tokens cannot be sampled (as HF min_new_tokens)."""
        for row, request in enumerate(sampling):
            params = request.sampling_params
            if request.num_output_tokens < params.min_tokens:
                banned = set(params.stop_token_ids)
                if not params.ignore_eos:
                    banned.update(request.eos_token_ids)
                if banned:
                    logits[row, list(banned)] = float("-inf")

    def _collect(self, sampling: list[Request], result: object) -> dict[str, SampledToken]:
        token_ids = result.sampled_token_ids.tolist()  # type: ignore[attr-defined]
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None  # type: ignore[attr-defined]
        top_ids = top_lps = None
        if result.top_logprob_token_ids is not None:  # type: ignore[attr-defined]
            top_ids = result.top_logprob_token_ids.tolist()  # type: ignore[attr-defined]
            top_lps = result.top_logprobs.tolist()  # type: ignore[attr-defined]
        sampled: dict[str, SampledToken] = {}
        for row, request in enumerate(sampling):
            token = SampledToken(token_ids[row])
            n = request.sampling_params.logprobs
            if n is not None and logprobs is not None:
                token.logprob = logprobs[row]
                if n > 0 and top_ids is not None and top_lps is not None:
                    token.top_logprobs = dict(zip(top_ids[row][:n], top_lps[row][:n]))
            sampled[request.request_id] = token
        return sampled
