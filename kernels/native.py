"""The native CPU kernels (kernels/csrc), loaded once, with the torch references as fallback.

``setup.py`` builds one library per CPU capability from the same C++ source
(``kernels._native_avx512`` / ``_native_avx2`` on x86-64, ``_native_default`` elsewhere).
:func:`native_kernels` loads the best one this CPU runs, as ATen reports it
(``torch.backends.cpu.get_cpu_capability()``), which registers the operators
``torch.ops.splitserve.paged_attention``, ``write_kv`` and the fused elementwise ops
(``rms_norm``, ``add_rms_norm_``, ``rotary_``, ``silu_mul``); their fake implementations
are registered here so ``torch.compile`` can trace through them.

Where no library was built (no compiler at install, an install with
``SPLITSERVE_SKIP_NATIVE=1``) or none loads (torch upgraded under it), one warning is
logged and :mod:`kernels.ops` runs the torch references instead.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import structlog
import torch

logger = structlog.get_logger(__name__)

# Libraries a CPU of each ATen capability can run, best first.
_CANDIDATES = {
    "AVX512": ("avx512", "avx2", "default"),
    "AVX2": ("avx2", "default"),
}


@dataclass(frozen=True)
class NativeKernels:
    """Which native library serves this process; ``variant`` is None when none does."""

    variant: str | None
    reason: str | None = None  # why none loaded

    @property
    def available(self) -> bool:
        return self.variant is not None


_loaded: NativeKernels | None = None


def native_kernels() -> NativeKernels:
    """Load the native kernels on first call (logging once if they are unavailable)."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
        if not _loaded.available:
            logger.warning(
                "native CPU kernels unavailable; the torch reference kernels serve (slower)",
                reason=_loaded.reason,
            )
    return _loaded


def _load() -> NativeKernels:
    capability = torch.backends.cpu.get_cpu_capability()
    failures = []
    for variant in _CANDIDATES.get(capability, ("default",)):
        path = _library_path(variant)
        if path is None:
            failures.append(f"{variant}: not built")
            continue
        if not hasattr(torch.ops.splitserve, "paged_attention"):  # else loaded already
            try:
                torch.ops.load_library(path)
            except (OSError, RuntimeError) as exc:
                failures.append(f"{variant}: {exc}")
                continue
            _register_fakes()
        return NativeKernels(variant)
    return NativeKernels(None, f"CPU capability {capability}; " + "; ".join(failures))


def _library_path(variant: str) -> str | None:
    """Where setup.py put the library of ``variant``, if it built one."""
    spec = importlib.util.find_spec(f"kernels._native_{variant}")
    return None if spec is None else spec.origin


def _register_fakes() -> None:
    """Shapes without data, for tracing (torch.compile, meta tensors)."""

    @torch.library.register_fake("splitserve::paged_attention")
    def _paged_attention_fake(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @torch.library.register_fake("splitserve::write_kv")
    def _write_kv_fake(key, value, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("splitserve::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("splitserve::add_rms_norm_")
    def _add_rms_norm_fake(x, residual, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("splitserve::rotary_")
    def _rotary_fake(qk, cos, sin):
        return None

    @torch.library.register_fake("splitserve::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def paged_attention_native(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], unit stride on head_dim
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], unit stride on head_dim
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    """The native kernel (loaded by :func:`native_kernels`); same contract as the reference."""
    return torch.ops.splitserve.paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    )


def write_kv_native(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; negative skips the token
) -> None:
    """The native slot write; same contract as :func:`kernels.kv_write.write_kv_ref`."""
    torch.ops.splitserve.write_kv(key, value, k_cache, v_cache, slot_mapping)


def bind_threads(cpus: list[int]) -> list[int]:
    """Set torch's intra-op threads to ``len(cpus)`` and pin thread i to ``cpus[i]`` (the
    calling thread is thread 0); returns the CPU each thread was pinned to (-1: refused)."""
    return list(torch.ops.splitserve.bind_threads(cpus))


def thread_cpus() -> list[int]:
    """Per intra-op thread, the one CPU it is pinned to, or -2 where it may run on several."""
    return list(torch.ops.splitserve.thread_cpus())
