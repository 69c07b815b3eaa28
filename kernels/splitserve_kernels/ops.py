"""The kernel entry points the engine calls.

Each op runs its Triton kernel when the tensors are on CUDA and Triton is installed. On the
CPU, ``paged_attention`` and ``write_kv`` run the native kernels (kernels/csrc, loaded by
native.py) and fall back to their torch references where those were not built;
``pack_kv`` / ``unpack_kv`` run their references. Importing this module needs neither
Triton, a GPU nor the native library. Shapes and semantics are documented beside each
kernel: kv_write.py, paged_attention.py, kv_pack.py.
"""

from collections.abc import Sequence

import torch

from splitserve_kernels import elementwise
from splitserve_kernels._triton_compat import HAS_TRITON
from splitserve_kernels import kv_int8
from splitserve_kernels.kv_pack import pack_kv_ref, pack_kv_triton, unpack_kv_ref, unpack_kv_triton
from splitserve_kernels.kv_write import write_kv_ref, write_kv_triton
from splitserve_kernels.native import native_kernels, paged_attention_native, write_kv_native
from splitserve_kernels.paged_attention import paged_attention_int8_triton, paged_attention_triton
from splitserve_kernels.paged_attention_ref import paged_attention_ref


def use_triton(device: torch.device) -> bool:
    """True when ops on tensors of ``device`` run the Triton kernels."""
    return HAS_TRITON and device.type == "cuda"


def use_native(device: torch.device) -> bool:
    """True when ops on tensors of ``device`` run the native CPU kernels."""
    return device.type == "cpu" and native_kernels().available


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    """Store each token's K/V at its slot (``block_id * block_size + offset``). An int8
    cache (kv_int8.py) stores them quantized, each row with its scale (natively for
    float32 K/V on CPU, kernels/csrc/kv_int8.cpp)."""
    if k_cache.dtype == torch.int8:
        if use_triton(key.device):
            int8_impl = kv_int8.write_kv_int8_triton
        elif use_native(key.device) and key.dtype == value.dtype == torch.float32:
            int8_impl = torch.ops.splitserve.write_kv_int8  # kernels/csrc/kv_int8.cpp
        else:
            int8_impl = kv_int8.write_kv_int8_ref
        int8_impl(key, value, k_cache, v_cache, slot_mapping)
        return
    if use_triton(key.device):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif use_native(key.device):
        write_kv_native(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch (decode, prefill, chunked prefill) over paged KV.
    An int8 cache is dequantized inside the attention call (kv_int8.py); the native
    kernel reads its rows and scales in place (float32 queries). ``batch_invariant``
    (``EngineConfig.batch_invariant``): the native kernel attends every row as a decode row, its
    keys never split, so a row's output depends on its own query and keys alone."""
    if batch_invariant:
        if not (use_native(query.device) and query.dtype == torch.float32):
            raise ValueError("paged_attention: batch_invariant needs the native kernel and float32 queries")
        return paged_attention_native(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      batch_invariant=True)
    if k_cache.dtype == torch.int8:
        if use_triton(query.device):
            int8_impl = paged_attention_int8_triton
        elif use_native(query.device) and query.dtype == torch.float32:
            int8_impl = paged_attention_native  # reads the int8 rows and their scales
        else:
            int8_impl = kv_int8.paged_attention_int8_ref
        return int8_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if use_triton(query.device):
        impl = paged_attention_triton
    elif use_native(query.device):
        impl = paged_attention_native
    else:
        impl = paged_attention_ref
    return impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def pack_kv(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
    out: torch.Tensor | None = None,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:  # [num_layers, 2, n, block_size, num_kv_heads, head_dim], contiguous
    """Copy the pages ``block_ids`` of every layer into one contiguous buffer (``out``, a
    reused staging buffer, when given)."""
    impl = pack_kv_triton if use_triton(kv_cache.device) else pack_kv_ref
    return impl(kv_cache, block_ids, out)


def unpack_kv(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], written
    buffer: torch.Tensor,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
) -> None:
    """Write page i of ``buffer`` into block ``block_ids[i]`` of every layer, in place."""
    impl = unpack_kv_triton if use_triton(kv_cache.device) else unpack_kv_ref
    impl(kv_cache, buffer, block_ids)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] int64
    """Each row's index of its largest value, the first on ties (``argmax``; a NaN counts as
    the largest). Natively on CPU (kernels/csrc/argmax.cpp: rows over the intra-op threads),
    else ``max(dim).indices``, which computes the same ~3x faster than ``argmax`` on CPU."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and 0 < logits.shape[1] < 1 << 24 and use_native(logits.device)):
        return torch.ops.splitserve.argmax_rows(logits)
    return logits.max(dim=-1).indices


def finite_rows(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] bool
    """Whether each row's values are all finite: its sum is (a NaN or an infinity carries
    into it; finite values sum past float32's range only at magnitudes no model gives, and
    such a row is no answer either). One read of the logits, no [rows, vocab] mask."""
    return torch.isfinite(logits.sum(dim=-1))


# -- the elementwise parts of a layer (elementwise.py, kernels/csrc/elementwise.cpp) --


def _native_rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and use_native(x.device)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """RMSNorm as transformers computes it (statistics in float32)."""
    if _native_rows(x) and weight.dtype == x.dtype and weight.is_contiguous():
        return torch.ops.splitserve.rms_norm(x, weight, eps)
    return elementwise.rms_norm_ref(x, weight, eps)


def add_rms_norm_(
    x: torch.Tensor,  # [rows, hidden], x += residual in place
    residual: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # rms_norm(x + residual)
    """A layer's residual add and the next RMSNorm in one pass."""
    if (_native_rows(x) and _native_rows(residual) and weight.dtype == x.dtype == residual.dtype
            and weight.is_contiguous()):
        return torch.ops.splitserve.add_rms_norm_(x, residual, weight, eps)
    return elementwise.add_rms_norm_ref(x, residual, weight, eps)


def rotary_(
    qk: torch.Tensor,  # [tokens, heads, head_dim], rotated in place
    cos: torch.Tensor,  # [tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [tokens, 1, head_dim]
) -> None:
    """Rotate-half RoPE in place (see :func:`splitserve_kernels.elementwise.rotary_ref`)."""
    native = qk.dtype == cos.dtype == signed_sin.dtype == torch.float32 and qk.stride(2) == 1
    if native and cos.is_contiguous() and signed_sin.is_contiguous() and use_native(qk.device):
        torch.ops.splitserve.rotary_(qk, cos, signed_sin)
    else:
        elementwise.rotary_ref(qk, cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """``silu(gate) * up`` of a fused gate/up projection."""
    if gate_up.dtype == torch.float32 and _native_rows(gate_up):
        return torch.ops.splitserve.silu_mul(gate_up)
    return elementwise.silu_mul_ref(gate_up)


__all__ = [
    "add_rms_norm_",
    "pack_kv",
    "paged_attention",
    "rms_norm",
    "rotary_",
    "silu_mul",
    "unpack_kv",
    "use_native",
    "use_triton",
    "write_kv",
]
