"""Write new tokens' keys and values into their paged-KV slots.

A slot id is ``block_id * block_size + offset_in_block``; a slot of ``-1`` (any negative
slot) means "do not store this token" (e.g. padding tokens of a CUDA graph batch).
Two tokens mapped to one slot is a caller bug; which one lands is unspecified.
"""

import torch

from splitserve_kernels._triton_compat import require_triton, tl, triton


def _check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key [.., num_kv_heads, head_dim] = {tuple(key.shape[1:])} does not match "
            f"the cache's {tuple(k_cache.shape[2:])}"
        )
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"key, value, k_cache, v_cache must share a dtype, got "
            f"{key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"slot_mapping must be [num_tokens={key.shape[0]}] int32/int64, "
            f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    """Torch reference (the CPU path): scatter each token's K/V rows into its slot."""
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] rows of K and of V.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    cache_offs = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]

    k = tl.load(
        key_ptr + tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(
        value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 skips the token
) -> None:
    """Triton version of :func:`write_kv_ref` (same arguments, same effect)."""
    require_triton()
    _check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must have a unit stride along head_dim")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # A contiguous cache seen as [num_slots, num_kv_heads, head_dim].
    stride_cache_slot, stride_cache_head = k_cache.stride(1), k_cache.stride(2)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        stride_cache_slot,
        stride_cache_head,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
