"""The paged KV cache tensor, allocated in the layout each device's kernels read best.

Its shape is the same everywhere, ``[num_layers, 2 (K, V), num_blocks, block_size,
num_kv_heads, head_dim]``, and every op reads it through its strides:

* CUDA: contiguous in that order (the Triton kernels' layout).
* CPU with the native kernels (kernels/native.py): head-major within a block. The storage
  is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` and the tensor
  returned is its permuted view, so one (block, KV head) is one contiguous
  ``block_size x head_dim`` tile that the native attention kernel streams (measured ~4%
  faster decode forwards than the token-major order).
* CPU without them, or an int8 cache (kernels/kv_int8.py: rows of head_dim int8 values and
  their float32 scale, which the native kernels do not read): contiguous, as on CUDA (the
  torch references' slot write needs it).

The layout that travels between workers is always the contiguous standard one:
``pack_kv`` produces it from either layout and ``unpack_kv`` writes it into either
(kernels/kv_pack.py, engine/kv_layout.py).
"""

from __future__ import annotations

import torch

from kernels.native import native_kernels


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
    if device.type != "cpu" or dtype == torch.int8 or not native_kernels().available:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)
    storage = torch.zeros(
        num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device
    )
    return storage.transpose(3, 4)
