"""The INT8 KV cache (``--kv-cache-dtype int8``): its row format, the quantizing K/V write
and paged attention that dequantizes as it reads (torch references here; the Triton write
below, the Triton attention in paged_attention.py with ``KV_INT8``).

A cache row (one token, one KV head) is ``head_dim + 4`` bytes: the int8 values, then the
row's float32 scale in native byte order, stored beside the values inside the page::

    k_cache  [num_blocks, block_size, num_kv_heads, head_dim + 4] int8
    row      | q[0] q[1] ... q[head_dim - 1] | scale (4 bytes) |      x[d] ~ q[d] * scale

``scale = max_d |x[d]| / 127`` (symmetric, per token and head), ``q = round(x / scale)``
rounding half away from zero. Because the scale lives in the page, everything that moves
pages moves scales with them unchanged: ``pack_kv`` / ``unpack_kv``, the transport, the
prefix cache. ``head_dim`` must be a multiple of 4 so the scale is 4-byte aligned and
``rows.view(torch.float32)[..., head_dim // 4]`` reads it.
"""

from __future__ import annotations

import torch

from splitserve_kernels._triton_compat import require_triton, tl, triton
from splitserve_kernels.paged_attention_ref import paged_attention_ref

SCALE_BYTES = 4


def row_width(head_dim: int) -> int:
    """Bytes of one (token, head) row of the int8 cache."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"int8 KV cache needs head_dim to be a multiple of 4, got {head_dim}")
    return head_dim + SCALE_BYTES


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    return torch.sign(y) * torch.floor(y.abs() + 0.5)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:  # [..., D] float -> [..., D + 4] int8
    """Rows in the int8 cache format (module docstring)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # NaN or inf where the row is not finite
    finite = torch.isfinite(scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(finite, _round_half_away(xf / safe).clamp(-127, 127), 0.0).to(torch.int8)
    return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)


def kv_scales(rows: torch.Tensor) -> torch.Tensor:  # [..., D + 4] int8 -> [...] float32
    head_dim = rows.shape[-1] - SCALE_BYTES
    return rows.view(torch.float32)[..., head_dim // SCALE_BYTES]


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # -> [..., D]
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].to(torch.float32) * kv_scales(rows)[..., None]
    return values.to(dtype)


def check_int8_cache(head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim + 4], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8:
        raise ValueError(f"int8 KV: caches must be int8, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.shape[3] != row_width(head_dim):
        raise ValueError(f"int8 KV: cache rows must be head_dim + 4 = {head_dim + 4}, got {k_cache.shape[3]}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("int8 KV: cache rows must be contiguous")


def write_kv_int8_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim + 4] int8, any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    """Torch reference (the CPU path): quantize each token's rows and store them at its slot."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    check_int8_cache(key.shape[2], k_cache, v_cache)
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv(key)
    v_cache[blocks, offsets] = quantize_kv(value)


def paged_attention_int8_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim + 4] int8
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference (the CPU path): the pages this batch reads are dequantized, inside
    the call, into a scratch cache of just those pages, and ``paged_attention_ref`` attends
    over it; nothing else of the cache is touched."""
    check_int8_cache(query.shape[2], k_cache, v_cache)
    used = torch.unique(block_tables.long())  # sorted; padding's page 0 at worst one extra
    remap = torch.zeros(k_cache.shape[0], dtype=torch.int32, device=query.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=query.device)
    k = dequantize_kv(k_cache.index_select(0, used), query.dtype)
    v = dequantize_kv(v_cache.index_select(0, used), query.dtype)
    return paged_attention_ref(query, k, v, remap[block_tables.long()], seq_lens, query_start_loc, scale)


@triton.jit
def _write_kv_int8_kernel(
    src_ptr, cache_ptr, cache_f32_ptr, slot_mapping_ptr,
    stride_src_tok, stride_src_head, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per token: quantize its [num_kv_heads, head_dim] rows of one of K or V.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_mask = offs_h < NUM_KV_HEADS
    x = tl.load(src_ptr + tok * stride_src_tok + offs_h[:, None] * stride_src_head + offs_d[None, :],
                mask=h_mask[:, None], other=0.0).to(tl.float32)
    # A row holding a NaN or an infinity (a NaN compares false) gets zeros under a NaN scale.
    finite = tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=1) == 0  # [BLOCK_H]
    scale = tl.where(finite, tl.max(tl.abs(x), axis=1) / 127.0, float("nan"))
    safe = tl.where(scale > 0, scale, 1.0)
    y = x / safe[:, None]
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    q = tl.where(finite[:, None], tl.minimum(tl.maximum(q, -127.0), 127.0), 0.0).to(tl.int8)
    row = slot * stride_cache_slot + offs_h * stride_cache_head  # int8 offsets of the rows
    tl.store(cache_ptr + row[:, None] + offs_d[None, :], q, mask=h_mask[:, None])
    tl.store(cache_f32_ptr + (row + HEAD_DIM) // 4, scale, mask=h_mask)


def write_kv_int8_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim + 4] int8, contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 skips the token
) -> None:
    """Triton version of :func:`write_kv_int8_ref`."""
    require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    check_int8_cache(head_dim, k_cache, v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or head_dim & (head_dim - 1):
        raise ValueError("int8 KV (Triton): contiguous caches and a power-of-two head_dim")
    if value.shape != key.shape or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be [num_tokens, num_kv_heads, head_dim], unit stride along head_dim")
    if num_tokens == 0:
        return
    for src, cache in ((key, k_cache), (value, v_cache)):
        _write_kv_int8_kernel[(num_tokens,)](
            src, cache, cache.view(torch.float32), slot_mapping,
            src.stride(0), src.stride(1), cache.stride(1), cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        )
