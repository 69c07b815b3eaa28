"""Process-level CPU settings for an engine process: intra-op threads, glibc malloc."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_glibc_malloc() -> bool:
    """Keep large freed blocks in the heap instead of returning them to the OS.

    A decode step allocates and frees the same tens-of-MB activations every layer. With
    glibc's defaults, blocks that large are ``mmap``-ed fresh and page-faulted in each
    time, which on CPU costs more than the arithmetic on them. Raising the mmap and trim
    thresholds lets the heap reuse them. Returns False where glibc is not the allocator.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(
        mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    )


def limit_malloc_arenas(count: int) -> bool:
    """At most ``count`` glibc malloc arenas in this process (``MALLOC_ARENA_MAX``, which
    glibc reads only when the process starts). It holds for threads that have not yet
    allocated, and only if none has needed a second arena yet: call it first thing.

    Why one (``splitserve.process_env``): glibc gives each new thread an arena of its own, and
    an arena other than the main one grows in heaps of at most 64 MiB that go back to the
    kernel whenever one is wholly free, whatever ``tune_glibc_malloc`` asks. A served worker's
    engine thread allocates and frees buffers of up to 25 MB in every layer of a prefill step,
    so they were page-faulted in again step after step (docs/measurements.md, "A
    twenty-third sitting"). Returns False where glibc is not the allocator."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, count))


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` (None elsewhere); looked up once a process (``find_library`` runs
    ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


def on_passing_thread(fn: Callable[[], T], name: str = "engine-build") -> T:
    """``fn()`` run on a new thread that ends when it returns; its result, or its error raised here.

    A service builds its engine this way and steps it on the engine thread. libgomp spins
    at a barrier only while the process has no more OpenMP threads than CPUs; above that it
    sleeps in the kernel at every fork and join. Each thread that runs a parallel region
    keeps its own team (the pool lives as long as the thread), so a model loaded on the
    main thread left a second team beside the engine thread's, and the 2-thread batch-1
    step of the default model took 47.5 ms instead of 30.5 on a 2-core machine. A passing
    thread's team ends with it.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def single_intra_op_thread() -> bool:
    """The calling thread runs torch's parallel ops on itself alone and never starts an
    OpenMP team; the other threads keep theirs. False where the native kernels are absent
    (torch has no per-thread setting; ``torch.set_num_threads`` is the process's)."""
    from splitserve_kernels.native import native_kernels, single_intra_op_thread

    if not native_kernels().available:
        return False
    single_intra_op_thread()
    return True


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


def bind_intra_op_threads(num_threads: int) -> list[int] | None:
    """Pin torch's ``num_threads`` intra-op threads one per CPU of the affinity mask, as vLLM's
    CPU worker does; returns the CPUs, or None where nothing was pinned.

    Unpinned, the scheduler can leave two threads of one OpenMP team on one core while
    another process holds the other, and every parallel region then waits at its barrier
    for a thread that cannot run. Pinned, each thread keeps its share of its own core. The
    calling thread (the engine's) becomes thread 0, pinned to the first CPU, and threads it
    starts later inherit that. One thread is left unpinned (no barrier to wait at), as is a
    count above the CPUs, and everything where the native kernels are not built.
    """
    from splitserve_kernels.native import bind_threads, native_kernels

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if num_threads < 2 or num_threads > len(cpus) or not native_kernels().available:
        return None
    return bind_threads(cpus[:num_threads])
