"""The native CPU kernels (kernels/csrc), loaded once, with the torch references as fallback.

``setup.py`` builds one library per CPU capability from the same C++ source
(``splitserve_kernels._native_avx512`` / ``_native_avx2`` on x86-64, ``_native_default`` elsewhere).
:func:`native_kernels` loads the best one this CPU runs, as ATen reports it
(``torch.backends.cpu.get_cpu_capability()``), which registers the operators
``torch.ops.splitserve.paged_attention`` (float caches and the int8 one), ``write_kv``,
``write_kv_int8``, ``gguf_linear`` (quant_matmul.py),
``pack_panels`` and ``panel_linear`` (engine/models/linear.py), ``decoder_layers`` (every
layer of those in one call, its weights in a ``DecoderWeights`` object: engine/models/llama.py),
``argmax_rows`` and ``greedy_head`` (greedy tokens, engine/models/greedy_head.py) and the fused elementwise ops (``rms_norm``, ``add_rms_norm_``,
``rotary_``, ``silu_mul``); their fake implementations are registered here so ``torch.compile`` can trace through them
(``pack_panels`` has none: it runs once per layer, at its first call, never inside a trace).

``SPLITSERVE_CPU_ISA`` (read at the first call) forces a choice: ``avx512`` or ``avx2`` loads
that library or fails with the reason (one the CPU cannot run is refused: it would fault),
``reference`` runs the torch references, ``auto`` (the default) picks. A forced choice is
logged once. To run the whole process as on an AVX2-only CPU, limit ATen and oneDNN before
torch starts: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (``auto`` then picks
the AVX2 library too, as ATen reports AVX2; ``make test-avx2``).

Each library sits beside a ``.torch`` file naming the torch it was compiled against (torch
has no stable C++ ABI); one built against another minor version is not loaded, and the
reason says what to reinstall. Where no library loads (no compiler at install, an install
with ``SPLITSERVE_SKIP_NATIVE=1``, another torch), one warning is logged and
:mod:`splitserve_kernels.ops` runs the torch references instead.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

logger = structlog.get_logger(__name__)

ISA_ENV = "SPLITSERVE_CPU_ISA"
# Libraries a CPU of each ATen capability can run, best first.
_CANDIDATES = {
    "AVX512": ("avx512", "avx2", "default"),
    "AVX2": ("avx2", "default"),
}
ISA_CHOICES = ("auto", "avx512", "avx2", "reference")


@dataclass(frozen=True)
class NativeKernels:
    """Which native library serves this process; ``variant`` is None when none does."""

    variant: str | None
    reason: str | None = None  # why none loaded
    requested: str = "auto"  # SPLITSERVE_CPU_ISA

    @property
    def available(self) -> bool:
        return self.variant is not None


_loaded: NativeKernels | None = None


def native_kernels() -> NativeKernels:
    """Load the native kernels on first call (logging a forced choice, or why none loaded);
    raise ``ValueError`` where
    ``SPLITSERVE_CPU_ISA`` asks for a library that cannot serve (never a silent fallback)."""
    global _loaded
    if _loaded is None:
        loaded = _load(os.environ.get(ISA_ENV, "auto").strip().lower() or "auto")
        if loaded.requested in ("avx512", "avx2") and not loaded.available:
            raise ValueError(f"{ISA_ENV}={loaded.requested}: {loaded.reason}")
        _loaded = loaded
        fields = dict(variant=_loaded.variant, requested=_loaded.requested,
                      aten_capability=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__)
        if _loaded.requested != "auto":  # a forced choice is logged; "auto" only where it failed
            logger.info("native CPU kernels", **fields, reason=_loaded.reason)
        elif not _loaded.available:
            logger.warning("native CPU kernels unavailable; the torch reference kernels serve (slower)",
                           **fields, reason=_loaded.reason)
    return _loaded


def choose_variants(requested: str, capability: str) -> tuple[str, ...]:
    """The libraries to try, best first, for ``SPLITSERVE_CPU_ISA=requested`` on a CPU whose
    ATen capability is ``capability``; empty for ``reference``. ``ValueError`` for an unknown
    value or a library this CPU cannot run."""
    candidates = _CANDIDATES.get(capability, ("default",))
    if requested not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV}={requested!r}: expected one of {', '.join(ISA_CHOICES)}")
    if requested == "auto":
        return candidates
    if requested == "reference":
        return ()
    if requested not in candidates:
        raise ValueError(f"{ISA_ENV}={requested}: this CPU runs {capability} (ATen's capability, "
                         f"ATEN_CPU_CAPABILITY can lower it); the {requested} kernels would fault on it")
    return (requested,)


def build_mismatch(built: str | None, running: str) -> str | None:
    """Why a library compiled against torch ``built`` must not load into torch ``running``
    (another minor version); None where it may (``built`` None: no record, loading decides)."""
    if built is None or _minor(built) == _minor(running):
        return None
    release = built.split("+")[0]
    return (f"built against torch {built}, this process runs torch {running} (torch's C++ ABI "
            f"changes between versions): reinstall splitserve against this torch "
            f"(pip install --no-build-isolation ., as make setup does) or install torch=={release}")


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _load(requested: str) -> NativeKernels:
    capability = torch.backends.cpu.get_cpu_capability()
    variants = choose_variants(requested, capability)
    if not variants:
        return NativeKernels(None, f"{ISA_ENV}=reference", requested)
    failures = []
    for variant in variants:
        problem = _try_load(variant)
        if problem is None:
            return NativeKernels(variant, None, requested)
        failures.append(f"{variant}: {problem}")
    return NativeKernels(None, f"CPU capability {capability}; " + "; ".join(failures), requested)


def _try_load(variant: str) -> str | None:
    """Load ``variant``'s library; None once its operators are registered, else why not."""
    path = _library_path(variant)
    if path is None:
        return "not built"
    built = built_against(path)
    mismatch = build_mismatch(built, torch.__version__)
    if mismatch is not None:
        return mismatch
    if hasattr(torch.ops.splitserve, "paged_attention"):  # loaded already
        return None
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        return f"{exc} (built against torch {built or 'unrecorded'}, running {torch.__version__})"
    _register_fakes()
    return None


def built_against(library: str) -> str | None:
    """The torch version setup.py recorded beside ``library``; None where it recorded none."""
    record = Path(library).parent / (Path(library).name.split(".", 1)[0] + ".torch")
    return record.read_text().strip() if record.is_file() else None


def _library_path(variant: str) -> str | None:
    """Where setup.py put the library of ``variant``, if it built one."""
    spec = importlib.util.find_spec(f"splitserve_kernels._native_{variant}")
    return None if spec is None else spec.origin


def _register_fakes() -> None:
    """Shapes without data, for tracing (torch.compile, meta tensors)."""

    @torch.library.register_fake("splitserve::paged_attention")
    def _paged_attention_fake(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                              batch_invariant=False):
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

    @torch.library.register_fake("splitserve::gguf_linear")
    def _gguf_linear_fake(x, blocks, kind):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("splitserve::argmax_rows")
    def _argmax_rows_fake(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.int64)

    @torch.library.register_fake("splitserve::greedy_head")
    def _greedy_head_fake(x, panels16, norms, panels, vocab):
        return x.new_empty(x.shape[0], dtype=torch.int64)

    @torch.library.register_fake("splitserve::panel_linear")
    def _panel_linear_fake(x, panels, out_features, bias):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("splitserve::decoder_layers")
    def _decoder_layers_fake(x, weights, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                             num_heads, num_kv_heads, head_dim, intermediate, eps, scale, batch_invariant=False,
                             seq_groups=()):
        return x.new_empty(x.shape)

    @torch.library.register_fake("splitserve::write_kv_int8")
    def _write_kv_int8_fake(key, value, k_cache, v_cache, slot_mapping):
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
    batch_invariant: bool = False,  # every row as a decode row, keys never split (attention_plan.h)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    """The native kernel (loaded by :func:`native_kernels`); same contract as the reference."""
    return torch.ops.splitserve.paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, batch_invariant
    )


def write_kv_native(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; negative skips the token
) -> None:
    """The native slot write; same contract as :func:`splitserve_kernels.kv_write.write_kv_ref`."""
    torch.ops.splitserve.write_kv(key, value, k_cache, v_cache, slot_mapping)


def bind_threads(cpus: list[int]) -> list[int]:
    """Set torch's intra-op threads to ``len(cpus)`` and pin thread i to ``cpus[i]`` (the
    calling thread is thread 0); returns the CPU each thread was pinned to (-1: refused)."""
    return list(torch.ops.splitserve.bind_threads(cpus))


def single_intra_op_thread() -> None:
    """The calling thread runs torch's parallel ops alone, starting no OpenMP team; other
    threads keep their counts (``torch.set_num_threads`` would change the process's)."""
    torch.ops.splitserve.single_intra_op_thread()


def thread_cpus() -> list[int]:
    """Per intra-op thread, the one CPU it is pinned to, or -2 where it may run on several."""
    return list(torch.ops.splitserve.thread_cpus())
