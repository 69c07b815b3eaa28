"""The shape of a worker's paged KV cache, as exchanged in the KV channel handshake.

Two workers may only exchange pages when every field matches: a page packed with one
layout and unpacked into another would be silently wrong attention, so a mismatch is a
``ValueError`` naming each differing field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays unimported here: the gateway reads layouts without it
    import torch  # noqa: F401 (annotations only)

# Element type name -> bytes per element.
_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# An int8 cache row is head_dim int8 values, then the row's float32 scale (kernels/splitserve_kernels/kv_int8.py).
INT8_SCALE_BYTES = 4


@dataclass(frozen=True)
class KVLayout:
    """kv_cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; ``dtype``
    names a torch dtype (``getattr(torch, layout.dtype)``). With ``dtype="int8"`` the last
    dimension of the cache and of packed pages is ``row_width = head_dim + 4`` bytes: the
    values and their scale (kernels/splitserve_kernels/kv_int8.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "int8"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "int8" and self.head_dim % INT8_SCALE_BYTES:
            raise ValueError(f"an int8 KV cache needs head_dim to be a multiple of 4, got {self.head_dim}")

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row in the cache and in packed pages."""
        return self.head_dim + (INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        """The layout of an allocated cache tensor."""
        num_layers, two, _, block_size, num_kv_heads, row_width = kv_cache.shape
        if two != 2:
            raise ValueError(f"kv_cache dim 1 must be 2 (K, V), got {two}")
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        head_dim = row_width - INT8_SCALE_BYTES if dtype == "int8" else row_width
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, K and V."""
        elems = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_width
        return elems * _DTYPES[self.dtype]

    def packed_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the buffer ``pack_kv`` makes for ``num_blocks`` pages."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ``ValueError`` naming every field where ``other`` differs from ``self``."""
        diffs = [
            f"{f.name}: local={getattr(self, f.name)!r} peer={getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise ValueError("KV layout mismatch (" + "; ".join(diffs) + ")")
