"""FramedChannel: the ordering and failure machinery GlooChannel and NcclChannel share.

Each direction's ops are numbered from 0 (``seq``) by the thread that runs them, and every op
carries a small int64 frame ``[seq, nbytes, tag]`` next to its payload (``nbytes`` is CANCELLED
for a :meth:`send_cancel` marker). ``tag`` is the caller's per-op tag: the services pass the
transfer's tag (``plumbing.identity.frame_tag``: a digest of the transfer id and its secret),
so a receive posted for one transfer can only ever be filled by the send made for that same
transfer. The receiving side checks the frame against its own count, its own tag and its
tensor's size (:func:`check_frame`) before any payload byte can land in the wrong place:
with Gloo, more bytes arriving than were posted aborts the whole process, and fewer silently
leave the tail unwritten; with NCCL a mismatch is undefined. A tag mismatch breaks the
channel like any frame mismatch. How the frame travels is the transport's choice (see
``_transmit``/``_receive`` in gloo.py and nccl.py).

Threads: ``send``/``recv``/``send_cancel``/``close`` run on the caller's thread;
``_transmit`` runs only on the sender thread and ``_receive`` only on the receiver thread
(one each, see :class:`~plumbing.transport.op_thread.OpThread`).
"""

from __future__ import annotations

import atexit
import threading
import time
from abc import abstractmethod
from concurrent.futures import Future

import structlog
import torch

from plumbing.transport.base import KVChannel, TransferCancelled, TransportError
from plumbing.transport.op_thread import Finish, OpThread

logger = structlog.get_logger(__name__)

CANCELLED = -1  # frame nbytes of a send_cancel() marker
FRAME_NUMEL = 3  # int64 [seq, nbytes, tag]
TAG_MIN, TAG_MAX = -(1 << 63), (1 << 63) - 1  # a tag is one int64
_CLOSE_GRACE_S = 0.25  # how long close() waits for an in-flight op before tearing down


class FramedChannel(KVChannel):
    """Base of the concrete channels; subclasses provide the wire primitives.

    Mutable state and its owner: ``_failure``/``_closed`` (``_lock``, any thread);
    ``_next_send_seq`` (sender thread only); ``_next_recv_seq`` (receiver thread only).
    ``_stop_requested`` is set by close() so primitives that poll can give up early.
    """

    recv_depth = 1  # receives the receiver thread may have started before finishing the oldest

    def __init__(self, rank: int, timeout_s: float) -> None:
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        check_timeout(timeout_s)
        self.rank = rank
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._failure: TransportError | None = None
        self._closed = False
        self._stop_requested = threading.Event()
        self._closed_error = TransportError(f"kv {self.kind.value} channel (rank {rank}) closed")
        self._next_send_seq = 0
        self._next_recv_seq = 0
        self._log = logger.bind(transport=self.kind.value, rank=rank)
        name = f"kv-{self.kind.value}-r{rank}"
        _track(self)
        self._sender = OpThread(f"{name}-send", self._on_op_error)
        self._receiver = OpThread(f"{name}-recv", self._on_op_error, depth=self.recv_depth)

    # -- public API (any thread) ---------------------------------------------------------

    def send(self, tensor: torch.Tensor, tag: int = 0) -> Future[None]:
        self._check_tensor(tensor, "send")
        check_tag(tag)
        ready = self._prepare(tensor)
        return self._sender.submit(lambda: self._run_send(tensor, tag, ready))

    def send_cancel(self, tag: int = 0) -> Future[None]:
        check_tag(tag)
        return self._sender.submit(lambda: self._run_send(None, tag, None))

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> Future[None]:
        self._check_tensor(tensor, "recv")
        check_tag(tag)
        ready = self._prepare(tensor)
        return self._receiver.submit(lambda: self._run_recv(tensor, tag, ready))

    @property
    def broken(self) -> bool:
        with self._lock:
            return self._failure is not None or self._closed

    @property
    def failure(self) -> str | None:
        with self._lock:
            return None if self._failure is None else str(self._failure)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failed = self._failure is not None
        with _OPEN_LOCK:
            _OPEN_CHANNELS.discard(self)
        self._stop_requested.set()
        workers = (self._sender, self._receiver)
        interrupted = any(worker.busy for worker in workers)
        for worker in workers:
            worker.fail_all(self._closed_error)
            worker.stop()
        if interrupted:
            self._interrupt()
        stopped = all([worker.join(_CLOSE_GRACE_S) for worker in workers])
        self._teardown(clean=not failed and not interrupted and stopped)
        self._log.info("kv channel closed", failed=failed, interrupted=interrupted,
                       threads_stopped=stopped)

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in (self._sender, self._receiver):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not worker.join(left):
                return False
        return True

    # -- what subclasses provide ---------------------------------------------------------

    def _check_tensor(self, tensor: torch.Tensor, op: str) -> None:
        """Caller thread: raise ValueError for a tensor this transport cannot carry."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{op} needs a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op} needs a contiguous tensor, got strides {tensor.stride()}")

    def _prepare(self, tensor: torch.Tensor) -> object:
        """Caller thread: capture what the op needs from the caller's context (NCCL: an
        event on the caller's current stream). Passed to the primitives as ``ready``."""
        return None

    @abstractmethod
    def _transmit(self, seq: int, tensor: torch.Tensor | None, tag: int, ready: object) -> Finish | None:
        """Sender thread: deliver op ``seq`` (``tensor``, or a cancel marker when None) framed
        with ``tag``. Returns None once the tensor may be reused, or a callable that waits."""

    @abstractmethod
    def _receive(self, seq: int, tensor: torch.Tensor, tag: int, ready: object) -> Finish | None:
        """Receiver thread: post op ``seq``'s receive into ``tensor``, expecting ``tag``; return
        None when it is complete, or a callable that completes it (up to ``recv_depth`` are
        outstanding). Raise TransferCancelled for a cancel marker, TransportError for a bad
        frame (order, tag or size)."""

    def _on_broken(self) -> None:
        """Called once, on the thread that broke the channel, after futures have failed:
        make the transport let go of in-flight ops and tell the peer, if it can."""

    def _interrupt(self) -> None:
        """close()'s thread, when ops were in flight: wake threads blocked in the transport."""

    @abstractmethod
    def _teardown(self, clean: bool) -> None:
        """close()'s thread: release the transport. ``clean``: the channel never broke, no
        op was in flight at close(), and both threads have exited."""

    # -- worker-thread bodies ------------------------------------------------------------

    def _run_send(self, tensor: torch.Tensor | None, tag: int, ready: object) -> Finish | None:
        seq = self._next_send_seq
        self._next_send_seq += 1
        return self._transmit(seq, tensor, tag, ready)

    def _run_recv(self, tensor: torch.Tensor, tag: int, ready: object) -> Finish | None:
        seq = self._next_recv_seq
        self._next_recv_seq += 1
        return self._receive(seq, tensor, tag, ready)

    def _on_op_error(self, exc: Exception) -> BaseException:
        """Worker thread: a cancel marker fails only its op; anything else breaks the channel."""
        if isinstance(exc, TransferCancelled):
            return exc
        with self._lock:
            first = self._failure is None and not self._closed
            if first:
                reason = exc if isinstance(exc, TransportError) else f"{type(exc).__name__}: {exc}"
                self._failure = TransportError(
                    f"kv {self.kind.value} channel (rank {self.rank}) broken: {reason}"
                )
                self._failure.__cause__ = exc
            error = self._failure if self._failure is not None else self._closed_error
        if first:
            self._log.warning("kv channel broken", reason=str(exc))
        self._sender.fail_all(error)
        self._receiver.fail_all(error)
        if first:
            self._on_broken()
        return error


def check_timeout(timeout_s: float) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")


_OPEN_CHANNELS: set[FramedChannel] = set()
_OPEN_LOCK = threading.Lock()
_atexit_registered = False


def _track(channel: FramedChannel) -> None:
    """Remember an open channel so interpreter exit closes it: a thread still blocked in a
    Gloo wait at exit makes the process abort (std::terminate) during teardown."""
    global _atexit_registered
    with _OPEN_LOCK:
        _OPEN_CHANNELS.add(channel)
        if not _atexit_registered:
            atexit.register(_close_open_channels)
            _atexit_registered = True


def _close_open_channels() -> None:
    with _OPEN_LOCK:
        channels = list(_OPEN_CHANNELS)
    for channel in channels:
        channel.close()


def frame_nbytes(tensor: torch.Tensor | None) -> int:
    """The frame's ``nbytes`` for a send of ``tensor`` (None: a cancel marker)."""
    return CANCELLED if tensor is None else tensor.nbytes


def check_tag(tag: int) -> None:
    if not isinstance(tag, int) or not TAG_MIN <= tag <= TAG_MAX:
        raise ValueError(f"tag must be an int64, got {tag!r}")


def check_frame(seq: int, frame: tuple[int, int, int], tensor: torch.Tensor, tag: int) -> bool:
    """Receiver side: True if ``frame`` is a cancel marker for op ``seq`` sent with ``tag``,
    False if the payload that follows was sent with ``tag`` and fits ``tensor`` exactly;
    TransportError otherwise (the payload must then not be used)."""
    frame_seq, nbytes, frame_tag = frame
    if frame_seq != seq:
        raise TransportError(f"frame out of order: peer sent op #{frame_seq}, expected #{seq}")
    if frame_tag != tag:
        raise TransportError(f"tag mismatch on op #{seq}: the peer sent it for another transfer")
    if nbytes == CANCELLED:
        return True
    if nbytes != tensor.nbytes:
        raise TransportError(
            f"size mismatch on op #{seq}: peer sent {nbytes} bytes, the receiving tensor "
            f"{tuple(tensor.shape)} {tensor.dtype} has {tensor.nbytes}"
        )
    return False
