"""The device side of the engine: owns the weights and the KV cache tensor, builds step
inputs, runs the model, samples."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine import cpu_tuning
from engine.config import EngineConfig
from engine.grammar import GrammarStats
from engine.grammar_masks import mask_logits, mask_verification
from engine.kv_layout import INT8_SCALE_BYTES, KVLayout
from engine.models.llama import ForwardBatch, LlamaModel
from engine.models.loader import load_hf_config, load_weights
from engine.models.spec import load_model_spec, resolve_max_model_len
from engine.quant.linear import WeightQuant, kept_gguf_types
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_probs, greedy_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from splitserve_kernels import ops
from splitserve_kernels.kv_cache import new_kv_cache

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class StepResult:
    """What a step produced: request id -> new tokens (1, or accepted drafts + 1 with
    speculation) and, for speculating requests, how many drafts were accepted."""

    tokens: dict[str, list[SampledToken]] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)
    # Request id -> why it gets no token: its logits (a row of them) were not all finite.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class SeqSlice:
    """Consecutive tokens of one sequence to run, starting at ``start_position``."""

    token_ids: list[int]
    start_position: int
    block_ids: list[int]


def make_forward_batch(
    slices: list[SeqSlice], logits_rows: list[int], block_size: int, device: torch.device
) -> ForwardBatch:
    """Flatten sequence slices into one ragged ``ForwardBatch`` (slots from block tables)."""
    token_ids: list[int] = []
    positions: list[int] = []
    seq_of_token: list[int] = []
    seq_lens: list[int] = []
    query_start = [0]
    for s, piece in enumerate(slices):
        n = len(piece.token_ids)
        token_ids.extend(piece.token_ids)
        positions.extend(range(piece.start_position, piece.start_position + n))
        seq_of_token.extend([s] * n)
        seq_lens.append(piece.start_position + n)
        query_start.append(query_start[-1] + n)
    max_blocks = max(len(p.block_ids) for p in slices)
    # int64 metadata: the native CPU kernels index with it as it is (int32 they would copy to
    # int64 in every layer's call), and the Triton kernels take either.
    block_tables = torch.tensor(
        [p.block_ids + [0] * (max_blocks - len(p.block_ids)) for p in slices], dtype=torch.int64
    )
    pos = torch.tensor(positions, dtype=torch.int64)
    seq_idx = torch.tensor(seq_of_token, dtype=torch.int64)
    slots = block_tables[seq_idx, pos // block_size] * block_size + pos % block_size
    return ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=pos.to(device),
        slot_mapping=slots.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int64, device=device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )


def kv_row_width(kv_cache_dtype: str, head_dim: int) -> int:
    """Last dimension of the KV cache: head_dim, or for int8 the values and their scale."""
    if kv_cache_dtype != "int8":
        return head_dim
    if head_dim % INT8_SCALE_BYTES:
        raise ValueError(f"kv_cache_dtype int8 needs head_dim to be a multiple of 4; the model's is {head_dim}")
    return head_dim + INT8_SCALE_BYTES


def _not_finite(request: Request) -> str:
    return (f"the model's logits for output token {request.num_output_tokens + 1} are not all finite "
            "(NaN or infinity: an overflow, or a weight that is not finite)")


def _is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with no history-dependent logit processing: the token is the raw argmax."""
    return params.greedy and params.repetition_penalty == 1.0


def _takes_the_argmax(request: Request) -> bool:
    """Whether the request's next token is the argmax of its raw logits with nothing else asked
    of them: plain greedy, no logprobs, no grammar, no stop tokens held back (``min_tokens``)."""
    params = request.sampling_params
    held_back = request.num_output_tokens < params.min_tokens and (
        bool(params.stop_token_ids) or (not params.ignore_eos and bool(request.eos_token_ids)))
    return _is_plain_greedy(params) and params.logprobs is None and request.grammar is None and not held_back


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        # Intra-op threads are the engine's: the config's, else every CPU this process may use.
        self.num_threads = config.num_threads or cpu_tuning.default_num_threads()
        torch.set_num_threads(self.num_threads)
        # Pinned on the first step, by the thread that steps (a service's engine thread):
        # OpenMP teams belong to the thread that starts them.
        self.thread_cpus: list[int] | None = None
        self._stepping_thread: int | None = None
        if config.device == "cpu":
            cpu_tuning.tune_glibc_malloc()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.hf_config = load_hf_config(config.model)
        self.spec = load_model_spec(config.model)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.spec)
        quant = None if config.quantization == "none" else WeightQuant(config.quantization, config.quant_group_size)
        weights = load_weights(config.model, self.dtype, kept_gguf_types(
            quant, self.device, self.dtype, config.keep_gguf_blocks))
        self.model = LlamaModel(self.spec, self.hf_config, weights, self.max_model_len, self.device, quant,
                                config.batch_invariant)
        self.block_size = config.block_size
        self.num_kv_blocks = config.resolve_num_kv_blocks(
            self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim
        )
        # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; head-major storage on CPU
        self.kv_cache = new_kv_cache(
            self.spec.num_layers,
            self.num_kv_blocks,
            self.block_size,
            self.spec.num_kv_heads,
            kv_row_width(config.kv_cache_dtype, self.spec.head_dim),
            torch.int8 if config.kv_cache_dtype == "int8" else self.dtype,
            self.device,
        )
        self.sampler = Sampler()
        self.spec_stats = SpecDecodeStats()
        self.grammar_stats = GrammarStats()  # mask counters; the engine's compiler adds its own

    def _own_intra_op_threads(self) -> None:
        """On the stepping thread: the configured thread count, pinned one per CPU if asked."""
        self._stepping_thread = threading.get_ident()
        torch.set_num_threads(self.num_threads)
        if self.config.bind_threads and self.config.device == "cpu":
            self.thread_cpus = cpu_tuning.bind_intra_op_threads(self.num_threads)

    # -- KV pages (transfer between workers) ---------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.of_cache(self.kv_cache)

    def pack_kv(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages ``block_ids`` of every layer, ``[num_layers, 2, n, block_size, kv_heads,
        head_dim]``, copied into one contiguous tensor on the cache's device (``out``)."""
        self._copy_alone_off_the_stepping_thread()
        return ops.pack_kv(self.kv_cache, block_ids, out)

    def unpack_kv(self, block_ids: list[int], packed: torch.Tensor) -> None:
        """Write page i of ``packed`` into block ``block_ids[i]`` of every layer. A buffer on
        another device is copied over first; a wrong shape or dtype is a ``ValueError``."""
        if not isinstance(packed, torch.Tensor):
            raise ValueError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
        want = self.kv_layout.packed_shape(len(block_ids))
        if tuple(packed.shape) != want or packed.dtype != self.kv_cache.dtype:  # int8: values + scales
            raise ValueError(
                f"packed must be {want} {self.kv_cache.dtype}, got {tuple(packed.shape)} {packed.dtype}"
            )
        self._copy_alone_off_the_stepping_thread()
        ops.unpack_kv(self.kv_cache, packed.to(self.device).contiguous(), block_ids)

    def _copy_alone_off_the_stepping_thread(self) -> None:
        """Pages are packed and unpacked on transport threads while the engine thread steps.
        Such a thread copies on itself alone: an OpenMP team of its own would leave the
        process with more OpenMP threads than CPUs, and every barrier of the step would then
        sleep in the kernel (``cpu_tuning.on_passing_thread``)."""
        if self.config.device == "cpu" and self._stepping_thread != threading.get_ident():
            cpu_tuning.single_intra_op_thread()

    # -- inputs ------------------------------------------------------------------------
    def prepare_batch(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]]
    ) -> tuple[ForwardBatch, list[Request], list[ScheduledRequest]]:
        """Flatten the scheduled requests. Returns the batch, the requests that sample one
        token and the scheduled items that verify drafts, each in logits-row order (plain
        sampling rows first, then k + 1 rows per verifying request)."""
        slices: list[SeqSlice] = []
        plain: list[Request] = []
        verifying: list[ScheduledRequest] = []
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        offset = 0
        for item in out.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            token_ids = request.all_token_ids[start : start + item.num_real_tokens] + item.spec_token_ids
            slices.append(SeqSlice(token_ids, start, block_ids[request.request_id]))
            offset += len(token_ids)
            if item.spec_token_ids:
                verifying.append(item)
                verify_rows.extend(range(offset - len(item.spec_token_ids) - 1, offset))
            elif item.samples:
                plain.append(request)
                plain_rows.append(offset - 1)
        batch = make_forward_batch(slices, plain_rows + verify_rows, self.block_size, self.device)
        return batch, plain, verifying

    # -- step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepResult:
        """Run one step: sample one token for each request that reached its end, and
        verify the drafts of speculating requests."""
        if self._stepping_thread != threading.get_ident():
            self._own_intra_op_threads()
        batch, plain, verifying = self.prepare_batch(out, block_ids)
        result = StepResult()
        if plain and not verifying and all(_takes_the_argmax(r) for r in plain):
            # No logit is processed or reported: the tokens alone (the model may skip most logits).
            tokens, finite = self.model.greedy(batch, self.kv_cache)
            for request, token, ok in zip(plain, tokens.tolist(), finite.tolist()):
                if ok:
                    result.tokens[request.request_id] = [SampledToken(token)]
                else:
                    result.failed[request.request_id] = _not_finite(request)
            return result
        logits = self.model.forward(batch, self.kv_cache)
        self._fail_non_finite(logits, plain, verifying, result)
        if plain:
            plain_logits = logits[: len(plain)]
            self._suppress_stop_tokens(plain_logits, plain)
            mask_logits(plain_logits, [r.grammar for r in plain], self.grammar_stats)
            metadata = SamplingMetadata.build(
                [r.sampling_params for r in plain],
                [r.all_token_ids for r in plain],
                [r.generator for r in plain],
                self.device,
            )
            self._collect(plain, self.sampler(plain_logits, metadata), result)
        if verifying:
            self._verify(verifying, logits[len(plain) :], result)
        for request_id in result.failed:
            result.tokens.pop(request_id, None)
            result.num_accepted.pop(request_id, None)
        return result

    @staticmethod
    def _fail_non_finite(logits: torch.Tensor, plain: list[Request], verifying: list[ScheduledRequest],
                         result: StepResult) -> None:
        """Fail the requests that own a logits row (``prepare_batch``'s order) that is not all
        finite: argmax would take a NaN as the largest value and sampling would raise. Those
        rows become zeros so the step's sampling runs on; their tokens are dropped after it."""
        finite = ops.finite_rows(logits)
        if bool(finite.all()):
            return
        rows = plain + [item.request for item in verifying for _ in range(len(item.spec_token_ids) + 1)]
        bad = ~finite
        logits[bad] = 0.0
        for row in bad.nonzero().flatten().tolist():
            result.failed.setdefault(rows[row].request_id, _not_finite(rows[row]))

    def _verify(self, items: list[ScheduledRequest], logits: torch.Tensor, result: StepResult) -> None:
        """Verify each request's drafts against the target's k + 1 logit rows (in item order).
        A constrained request's rows are masked by its grammar and its drafts cut at the first
        one the grammar forbids (``engine/grammar_masks.py``)."""
        drafts = [list(item.spec_token_ids) for item in items]
        logits, drafts = mask_verification(logits, drafts, [i.request.grammar for i in items], self.grammar_stats)
        if all(_is_plain_greedy(item.request.sampling_params) for item in items):
            outputs = self._verify_greedy(drafts, logits)
        else:
            outputs = self._verify_sampled(items, drafts, logits)
        for item, token_ids in zip(items, outputs):
            request_id = item.request.request_id
            result.tokens[request_id] = [SampledToken(t) for t in token_ids]
            result.num_accepted[request_id] = len(token_ids) - 1
        self.spec_stats.observe(
            [len(item.spec_token_ids) for item in items], [len(t) - 1 for t in outputs]
        )

    @staticmethod
    def _verify_greedy(drafts: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
        """All rows greedy without penalties: the target token at every row is the argmax of
        the raw logits, so one argmax and one host copy serve the whole step."""
        target_ids = greedy_tokens(logits).tolist()  # [sum(k + 1)]
        outputs, row = [], 0
        for row_drafts in drafts:
            k = len(row_drafts)
            outputs.append(greedy_verify(row_drafts, target_ids[row : row + k + 1]))
            row += k + 1
        return outputs

    def _verify_sampled(
        self, items: list[ScheduledRequest], drafts: list[list[int]], logits: torch.Tensor
    ) -> list[list[int]]:
        """Any sampling row: processed target distributions and ``rejection_sample``."""
        requests = [item.request for item in items]
        ks = [len(d) for d in drafts]
        rows_params = [r.sampling_params for r, k in zip(requests, ks) for _ in range(k + 1)]
        rows_history = [r.all_token_ids for r, k in zip(requests, ks) for _ in range(k + 1)]
        rows_gens = [r.generator for r, k in zip(requests, ks) for _ in range(k + 1)]
        metadata = SamplingMetadata.build(rows_params, rows_history, rows_gens, self.device)
        flat_probs = compute_probs(logits, metadata)  # [sum(k + 1), vocab]
        max_k = max(ks)
        vocab = flat_probs.shape[1]
        target_probs = flat_probs.new_zeros(len(items), max_k + 1, vocab)
        draft_ids = torch.zeros(len(items), max_k, dtype=torch.int64)
        # Rows without draft_probs (deterministic drafts) put probability 1 on each draft.
        has_draft_probs = any(r.draft_probs is not None for r in requests)
        draft_probs = flat_probs.new_zeros(len(items), max_k, vocab) if has_draft_probs else None
        row = 0
        for i, (item, k) in enumerate(zip(items, ks)):
            target_probs[i, : k + 1] = flat_probs[row : row + k + 1]
            draft_ids[i, :k] = torch.tensor(drafts[i], dtype=torch.int64)
            if draft_probs is not None:
                if item.request.draft_probs is not None:
                    draft_probs[i, :k] = item.request.draft_probs[:k]
                else:
                    draft_probs[i, torch.arange(k), draft_ids[i, :k]] = 1.0
            row += k + 1
        outcome = rejection_sample(
            draft_ids.to(self.device),
            torch.tensor(ks, dtype=torch.int64, device=self.device),
            draft_probs,
            target_probs,
            torch.tensor([r.sampling_params.greedy for r in requests], device=self.device),
            [r.generator for r in requests],
        )
        tokens = outcome.output_token_ids.tolist()
        num_output = outcome.num_output.tolist()
        return [tokens[i][: num_output[i]] for i in range(len(items))]

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

    def _collect(self, sampling: list[Request], sampled: SamplerOutput, result: StepResult) -> None:
        token_ids = sampled.sampled_token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = top_lps = None
        if sampled.top_logprob_token_ids is not None and sampled.top_logprobs is not None:
            top_ids = sampled.top_logprob_token_ids.tolist()
            top_lps = sampled.top_logprobs.tolist()
        for row, request in enumerate(sampling):
            token = SampledToken(token_ids[row])
            n = request.sampling_params.logprobs
            if n is not None and logprobs is not None:
                token.logprob = logprobs[row]
                if n > 0 and top_ids is not None and top_lps is not None:
                    token.top_logprobs = dict(zip(top_ids[row][:n], top_lps[row][:n]))
            result.tokens[request.request_id] = [token]
