"""Process-level CPU settings for an engine process: intra-op threads, glibc malloc."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (what ``taskset``, cgroup cpusets
    and container CPU pinning leave it), else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def default_num_threads() -> int:
    """Intra-op threads of an engine whose ``EngineConfig.num_threads`` is None: every CPU
    it may use, so a process does not need ``OMP_NUM_THREADS`` exported to use its cores."""
    return available_cpus()
