"""Process-level CPU settings for an engine process (glibc malloc tuning)."""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_glibc_malloc() -> bool:
    """Keep large freed blocks in the heap instead of returning them to the OS.

    A decode step allocates and frees the same tens-of-MB activations every layer. With
    glibc's defaults, blocks that large are ``mmap``-ed fresh and page-faulted in each
    time, which on CPU costs more than the arithmetic on them. Raising the mmap and trim
    thresholds lets the heap reuse them. Returns False where glibc is not the allocator.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(
        mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    )
