"""KV pages on a channel in chunks, pipelined, through reused staging buffers.

A transfer of ``num_blocks`` pages travels as consecutive messages of at most
``chunk_blocks`` pages each, all framed with the transfer's tag (``chunk_ranges``). Both
sides post every message of a transfer at once, so the pair's order never depends on
timing; the overlap comes from the channel's threads::

    sender (caller's thread)        sender thread          receiver thread (up to RECV_DEPTH posted)
    pack chunk 0 ─▶ send ─────────▶ wire chunk 0 ────────▶ chunk 0 lands ─▶ on_chunk: unpack 0
    pack chunk 1 ─▶ send ─────────▶ wire chunk 1 ────────▶ chunk 1 lands ─▶ on_chunk: unpack 1
    ...                             (while chunk 2 packs)  (while chunk 2 is on the wire)

so pack, wire and unpack overlap instead of running one after another. Staging buffers
come from a ``StagingPool`` (on the channel's device: CPU for Gloo, the GPU for NCCL) and go
back only after their op *succeeded*: a failed op's
buffer may still be in the transport's hands (``OpThread``: futures fail before the
transport lets go), so it is dropped instead of reused.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future

import torch

from plumbing.transport.base import KVChannel

# About 8 MiB a message: on a loaded 2-core machine each op costs ~1 ms of frames and thread
# hand-offs, which smaller chunks pay more often than the overlap wins back (bench.kv_transfer
# --chunk-mib 2 / 8 / 32).
DEFAULT_CHUNK_BYTES = 8 << 20
MAX_KEPT_PER_SHAPE = 8  # staging buffers kept per shape once returned


def chunk_blocks_for(bytes_per_block: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Pages per message for about ``chunk_bytes`` per message (at least one page)."""
    if bytes_per_block < 1 or chunk_bytes < 1:
        raise ValueError(f"bytes_per_block and chunk_bytes must be >= 1, got {bytes_per_block}, {chunk_bytes}")
    return max(1, chunk_bytes // bytes_per_block)


def chunk_ranges(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(first page, pages) of each message of a ``num_blocks``-page transfer; ``chunk_blocks``
    0 means one message."""
    if num_blocks < 0 or chunk_blocks < 0:
        raise ValueError(f"num_blocks and chunk_blocks must be >= 0, got {num_blocks}, {chunk_blocks}")
    step = chunk_blocks or max(num_blocks, 1)
    return [(start, min(step, num_blocks - start)) for start in range(0, num_blocks, step)]


class StagingPool:
    """Reusable contiguous buffers by (shape, dtype, device); thread-safe."""

    def __init__(self, max_kept_per_shape: int = MAX_KEPT_PER_SHAPE) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._max_kept = max_kept_per_shape
        self.num_allocated = 0  # buffers made (the rest of the takes were reuses)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        key = (tuple(shape), dtype, str(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
            self.num_allocated += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Return a buffer nobody touches any more (the transport included)."""
        key = (tuple(tensor.shape), tensor.dtype, str(tensor.device))
        with self._lock:
            free = self._free[key]
            if len(free) < self._max_kept:
                free.append(tensor)


def send_chunks(channel: KVChannel, chunks: list[tuple[int, int]], tag: int, pool: StagingPool,
                shape_of: Callable[[int], tuple[int, ...]], dtype: torch.dtype,
                pack: Callable[[int, int, torch.Tensor], None], device: torch.device | str = "cpu") -> Future[None]:
    """Blocking (packs on the caller's thread): for each chunk, ``pack(start, n, buffer)``
    then post its send; returns the last send's future (ops settle in order, and a failure
    fails every later one). Should a pack fail, the chunks left are sent as cancel markers
    so the peer's posted receives stay matched, and the error is raised."""
    last: Future[None] | None = None
    for i, (start, num) in enumerate(chunks):
        buffer = pool.take(shape_of(num), dtype, device)
        try:
            pack(start, num, buffer)
        except BaseException:
            for _ in chunks[i:]:
                channel.send_cancel(tag)
            raise
        last = channel.send(buffer, tag=tag)
        last.add_done_callback(lambda f, b=buffer: f.exception() is None and pool.give(b))
    if last is None:
        raise ValueError("a transfer needs at least one chunk")
    return last


def recv_chunks(channel: KVChannel, chunks: list[tuple[int, int]], tag: int, pool: StagingPool,
                shape_of: Callable[[int], tuple[int, ...]], dtype: torch.dtype,
                unpack: Callable[[int, torch.Tensor], None], device: torch.device | str = "cpu") -> Future[None]:
    """Post every message's receive now (in order); as each lands, ``unpack(first_page,
    buffer)`` runs on the receiver thread while later ones are on the wire. The future is done
    after the last unpack, or fails with the first error. (The decode worker's ``KVInbox``
    does the same under its reservation's lock.)"""
    done: Future[None] = Future()
    left = [len(chunks)]
    lock = threading.Lock()

    def landed(start: int, buffer: torch.Tensor, error: BaseException | None) -> None:
        with lock:
            if done.done():
                return
            if error is None:
                try:
                    unpack(start, buffer)
                except Exception as exc:  # noqa: BLE001 - fails the transfer
                    error = exc
                else:
                    pool.give(buffer)
            if error is not None:
                done.set_exception(error)
                return
            left[0] -= 1
            if not left[0]:
                done.set_result(None)

    for start, num in chunks:
        buffer = pool.take(shape_of(num), dtype, device)
        future = channel.recv(buffer, tag=tag)
        future.add_done_callback(lambda f, s=start, b=buffer: landed(s, b, f.exception()))
    return done
