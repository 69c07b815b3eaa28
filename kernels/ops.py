"""The kernel entry points the engine calls.

Each op runs its Triton kernel when the tensors are on CUDA and Triton is installed, and
its torch reference otherwise (the CPU path). Importing this module needs neither Triton
nor a GPU. Shapes and semantics are documented beside each kernel:
kernels/kv_write.py, kernels/paged_attention.py, kernels/kv_pack.py.
"""

from collections.abc import Sequence

import torch

from kernels._triton_compat import HAS_TRITON
from kernels import kv_int8
from kernels.kv_pack import pack_kv_ref, pack_kv_triton, unpack_kv_ref, unpack_kv_triton
from kernels.kv_write import write_kv_ref, write_kv_triton
from kernels.paged_attention import paged_attention_int8_triton, paged_attention_triton
from kernels.paged_attention_ref import paged_attention_ref


def use_triton(device: torch.device) -> bool:
    """True when ops on tensors of ``device`` run the Triton kernels."""
    return HAS_TRITON and device.type == "cuda"


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    """Store each token's K/V at its slot (``block_id * block_size + offset``). An int8
    cache (kernels/kv_int8.py) stores them quantized, each row with its scale."""
    if k_cache.dtype == torch.int8:
        int8_impl = kv_int8.write_kv_int8_triton if use_triton(key.device) else kv_int8.write_kv_int8_ref
        int8_impl(key, value, k_cache, v_cache, slot_mapping)
        return
    impl = write_kv_triton if use_triton(key.device) else write_kv_ref
    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, new tokens included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch (decode, prefill, chunked prefill) over paged KV.
    An int8 cache is dequantized inside the attention call (kernels/kv_int8.py)."""
    if k_cache.dtype == torch.int8:
        int8_impl = paged_attention_int8_triton if use_triton(query.device) else kv_int8.paged_attention_int8_ref
        return int8_impl(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    impl = paged_attention_triton if use_triton(query.device) else paged_attention_ref
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


__all__ = ["pack_kv", "paged_attention", "unpack_kv", "use_triton", "write_kv"]
