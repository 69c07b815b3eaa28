"""Pack a sequence's KV pages into one contiguous buffer, and unpack them elsewhere.

Used for KV transfer between workers: the sender packs its block ids, ships one buffer,
the receiver unpacks into the block ids it reserved (usually different ones)::

    kv_cache [num_layers, 2, num_blocks, block_size, kv_heads, D]     (2: K then V)
    buffer   [num_layers, 2, len(block_ids), block_size, kv_heads, D]
    buffer[l, kv, i] == kv_cache[l, kv, block_ids[i]]

``block_ids`` must be in range (the Triton kernel does not check) and, for unpack,
distinct (which copy lands in a repeated block is unspecified).
"""

from collections.abc import Sequence

import torch

from splitserve_kernels._triton_compat import require_triton, tl, triton


def _as_block_ids(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if not isinstance(block_ids, torch.Tensor):
        return torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_ids must be 1-D int32/int64, got {tuple(block_ids.shape)} {block_ids.dtype}"
        )
    return block_ids.to(device)


def _check_kv_cache(kv_cache: torch.Tensor, contiguous: bool) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if contiguous and not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")


def _check_buffer(kv_cache: torch.Tensor, buffer: torch.Tensor, num_ids: int) -> None:
    want = (*kv_cache.shape[:2], num_ids, *kv_cache.shape[3:])
    if tuple(buffer.shape) != want or buffer.dtype != kv_cache.dtype:
        raise ValueError(
            f"buffer must be {want} {kv_cache.dtype}, got {tuple(buffer.shape)} {buffer.dtype}"
        )
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous")


def pack_kv_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
    out: torch.Tensor | None = None,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:  # [num_layers, 2, n, block_size, num_kv_heads, head_dim], contiguous
    """Torch reference: gather the pages ``block_ids`` of every layer into ``out`` (a new
    buffer when None). ``kv_cache`` may have any strides (the CPU cache is a head-major view,
    kv_cache.py); the buffer is contiguous in the logical order, the layout that travels."""
    _check_kv_cache(kv_cache, contiguous=False)
    ids = _as_block_ids(block_ids, kv_cache.device)
    if out is None:
        return torch.index_select(kv_cache, 2, ids).contiguous()
    _check_buffer(kv_cache, out, ids.shape[0])
    return torch.index_select(kv_cache, 2, ids, out=out)


def unpack_kv_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], written
    buffer: torch.Tensor,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
) -> None:
    """Torch reference: write page i of ``buffer`` into block ``block_ids[i]``, in place
    (``kv_cache`` of any strides, ``buffer`` contiguous)."""
    _check_kv_cache(kv_cache, contiguous=False)
    ids = _as_block_ids(block_ids, kv_cache.device)
    _check_buffer(kv_cache, buffer, ids.shape[0])
    kv_cache.index_copy_(2, ids.long(), buffer)


@triton.jit
def _copy_pages_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    src_pages_per_group,
    dst_pages_per_group,
    PAGE_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
):
    # Program (i, group, chunk) copies BLOCK elements of page i of group (layer, k/v).
    # GATHER: cache page block_ids[i] -> buffer page i; else buffer page i -> block_ids[i].
    i = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_page = group * src_pages_per_group + block_id
        dst_page = group * dst_pages_per_group + i
    else:
        src_page = group * src_pages_per_group + i
        dst_page = group * dst_pages_per_group + block_id
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_NUMEL
    x = tl.load(src_ptr + src_page * PAGE_NUMEL + offs, mask=mask)
    tl.store(dst_ptr + dst_page * PAGE_NUMEL + offs, x, mask=mask)


MAX_COPY_BLOCK = 2048  # elements per program


def _launch_copy_pages(
    kv_cache: torch.Tensor, buffer: torch.Tensor, ids: torch.Tensor, gather: bool
) -> None:
    num_layers, _, num_blocks = kv_cache.shape[:3]
    num_ids = ids.shape[0]
    if num_ids == 0:
        return
    page_numel = kv_cache[0, 0, 0].numel()
    block = min(triton.next_power_of_2(page_numel), MAX_COPY_BLOCK)
    grid = (num_ids, num_layers * 2, triton.cdiv(page_numel, block))
    src, dst = (kv_cache, buffer) if gather else (buffer, kv_cache)
    src_pages = num_blocks if gather else num_ids
    dst_pages = num_ids if gather else num_blocks
    _copy_pages_kernel[grid](
        src, dst, ids, src_pages, dst_pages, PAGE_NUMEL=page_numel, BLOCK=block, GATHER=gather
    )


def pack_kv_triton(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
    out: torch.Tensor | None = None,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:  # [num_layers, 2, n, block_size, num_kv_heads, head_dim], contiguous
    """Triton version of :func:`pack_kv_ref` (``kv_cache`` contiguous)."""
    require_triton()
    _check_kv_cache(kv_cache, contiguous=True)
    ids = _as_block_ids(block_ids, kv_cache.device).contiguous()
    if out is not None:
        _check_buffer(kv_cache, out, ids.shape[0])
    buffer = out if out is not None else torch.empty(
        (*kv_cache.shape[:2], ids.shape[0], *kv_cache.shape[3:]),
        dtype=kv_cache.dtype,
        device=kv_cache.device,
    )
    _launch_copy_pages(kv_cache, buffer, ids, gather=True)
    return buffer


def unpack_kv_triton(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], written
    buffer: torch.Tensor,  # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor | Sequence[int],  # [n]
) -> None:
    """Triton version of :func:`unpack_kv_ref` (``kv_cache`` contiguous)."""
    require_triton()
    _check_kv_cache(kv_cache, contiguous=True)
    ids = _as_block_ids(block_ids, kv_cache.device).contiguous()
    _check_buffer(kv_cache, buffer, ids.shape[0])
    _launch_copy_pages(kv_cache, buffer, ids, gather=False)
