"""Engine configuration: a frozen, validated dataclass built once at the entry point."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.config import SpeculativeConfig

_DTYPES = ("float32", "bfloat16", "float16")
_QUANTIZATIONS = ("none", "int8", "int4")
_QUANT_GROUP_SIZES = (32, 64, 128)
_KV_CACHE_DTYPES = ("auto", "int8")
KV_INT8_SCALE_BYTES = 4  # one float32 scale per (token, kv head) row (kernels/splitserve_kernels/kv_int8.py)
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and how much memory it may use.

    The KV pool is sized by ``num_kv_blocks`` when given, else by ``kv_cache_bytes``
    (default 512 MiB). ``max_model_len`` defaults to the checkpoint's
    ``max_position_embeddings``. ``num_threads`` is the torch intra-op thread count the
    engine sets when it starts; None means every CPU the process may run on (its affinity
    mask, ``engine.cpu_tuning.default_num_threads``), so no ``OMP_NUM_THREADS`` is needed.
    With ``bind_threads`` (default) and more than one thread, the thread that steps the
    engine pins its intra-op threads one per CPU of the mask on its first step, as vLLM's
    CPU worker does (``engine.cpu_tuning.bind_intra_op_threads``); threads that thread
    starts afterwards inherit its CPU. On cores shared with other busy processes fewer
    threads can still be faster: every OpenMP region waits for its slowest thread.

    Quantization: ``quantization`` ``"int8"`` / ``"int4"`` quantizes the weights at load
    (engine/quant/linear.py; int4 in groups of ``quant_group_size`` input features);
    ``kv_cache_dtype="int8"`` stores K/V as int8 with a float32 scale per token and head
    (kernels/splitserve_kernels/kv_int8.py); ``"auto"`` stores them in ``dtype``.

    ``batch_invariant``: every float32 linear runs the native panel GEMM at every row count
    (its sums in an order fixed by the weight's shape), and paged attention attends every row
    as a decode row with its keys never split, so a row's output depends on its own query and
    keys alone: a request's logits are the same bits whatever else its steps carry, and a
    prefill of prompt + sent tokens continues its stream bit for bit. It needs the native
    library and float32 weights, and refuses quantization and speculative decoding (whether a
    request speculates depends on the batch, and a sampled request's tokens on its drafts).
    docs/architecture.md, "Batch invariance", says what it covers and what it costs.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: the CPUs this process may use
    bind_threads: bool = True  # pin each intra-op thread to one CPU (engine.cpu_tuning)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Incremental text in outputs (RequestOutput.new_text). The serving workers turn it off:
    # only the gateway needs text, and it detokenizes there.
    detokenize: bool = True
    quantization: str = "none"  # "none" | "int8" | "int4": weight-only, at load
    quant_group_size: int = 32  # int4: input features per scale/zero group
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) | "int8"
    keep_gguf_blocks: bool = True  # float32: a GGUF file's Q8_0 / Q4_1 tensors stay blocks
    batch_invariant: bool = False  # a request's logits the same bits in any batch (above)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a local checkpoint directory or GGUF file")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        self._validate_quantization()
        self._validate_batch_invariant()

    def _validate_quantization(self) -> None:
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        if self.quant_group_size not in _QUANT_GROUP_SIZES:
            raise ValueError(f"quant_group_size must be one of {_QUANT_GROUP_SIZES}, got {self.quant_group_size}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    def _validate_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        for field, value, allowed in (("dtype", self.dtype, "float32"), ("device", self.device, "cpu"),
                                      ("quantization", self.quantization, "none")):
            if value != allowed:
                raise ValueError(f"batch_invariant needs {field}={allowed!r}, got {value!r}")
        if self.speculative is not None:
            raise ValueError("batch_invariant refuses speculative decoding: whether a request speculates "
                             "depends on the batch, and a sampled request's tokens on its drafts")

    @property
    def quantization_name(self) -> str:
        """How workers report it (registration, GetInfo): "none", "int8" or "int4-g<group>"."""
        return f"int4-g{self.quant_group_size}" if self.quantization == "int4" else self.quantization

    def kv_block_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        if self.kv_cache_dtype == "int8":  # int8 values, then the row's float32 scale
            return 2 * num_layers * self.block_size * num_kv_heads * (head_dim + KV_INT8_SCALE_BYTES)
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * itemsize

    def resolve_num_kv_blocks(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // self.kv_block_bytes(num_layers, num_kv_heads, head_dim)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={budget} is smaller than one KV block")
        return int(num_blocks)
