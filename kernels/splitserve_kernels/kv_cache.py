"""The paged KV cache tensor, allocated in the layout each device's kernels read best.

Its shape is the same everywhere, ``[num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]``, and every op reads it through its strides:

* CUDA: contiguous in that order (the Triton kernels' layout).
* CPU with the native kernels (native.py): head-major within a block. The storage
  is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` and the tensor
  returned is its permuted view, so one (block, KV head) is one contiguous
  ``block_size x head_dim`` tile that the native attention kernel streams (measured ~4%
  faster decode forwards than the token-major order). An int8 cache too (kv_int8.py: its
  "head_dim" is the row's int8 values and float32 scale): token-major, a KV head's 68-byte
  rows of a page lay 204 bytes apart on the default model, and reading them pulled in the
  other heads' bytes as well. A batch-64 decode over 30 layers' caches (~200-token contexts,
  Zen 3, 2 threads, 20 interleaved rounds, min-median ms): token-major 31.4-35.5 without the
  rows asked for ahead, 29.3-32.8 with; head-major 22.4-26.8 with; float32 35.1-38.0.
* CPU without them: contiguous, as on CUDA.

On CPU the cache's memory is asked for in huge pages (``madvise(MADV_HUGEPAGE)``, where the
kernel's transparent huge pages are ``madvise`` or ``always``) before it is zeroed: decode
attention reads a 4 KB page of K and one of V per chunk from anywhere in the cache, and with
4 KB pages nearly every chunk also missed the TLB (a batch-64 decode call on the default
model's shapes, one thread over 30 layers' caches: 1712-2035 us with 4 KB pages, 1455-1503
with huge pages).

The layout that travels between workers is always the contiguous standard one:
``pack_kv`` produces it from either layout and ``unpack_kv`` writes it into either
(kv_pack.py, engine/kv_layout.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

from splitserve_kernels.native import native_kernels


def new_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed
    """A zeroed cache; a head-major view where the native CPU kernels serve (module docstring)."""
    if device.type != "cpu" or not native_kernels().available:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)
    storage = torch.empty(
        num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device
    )
    advise_huge_pages(storage)
    return storage.zero_().transpose(3, 4)


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside a CPU tensor's memory with huge pages;
    call it before the memory is first written. True where the kernel took the advice (False
    elsewhere: another OS, transparent huge pages off, a tensor under 2 MiB)."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    aligned = (start + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    length = (start + size - aligned) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
