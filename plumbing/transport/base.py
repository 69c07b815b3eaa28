"""The KV channel contract: a 2-rank, ordered, point-to-point pipe for packed KV pages.

One channel joins one prefill worker (rank 0, which hosts the rendezvous and sends) to one
decode worker (rank 1, which receives). Both ranks must post their ops in the same order
(NCCL has no tags), so every channel runs each direction on one thread::

    caller threads ──send(t)──▶ [FIFO] ──▶ sender thread   ──▶ wire ──▶ peer's receiver thread
    caller threads ──recv(t)──▶ [FIFO] ──▶ receiver thread ◀── wire ◀── peer's sender thread

A call returns at once with a ``Future``; the future completes on the channel's thread when
the op is done (send: the tensor may be reused; recv: the tensor holds the data), or fails
with :class:`TransportError`. Any failure breaks the whole channel: every pending and later
op fails fast, and the owner replaces the channel (a new handshake).

This module imports neither torch nor NCCL, so ``import plumbing.transport`` stays light.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TransportKind(enum.Enum):
    GLOO = "gloo"  # CPU tensors over TCP (torch's ProcessGroupGloo)
    NCCL = "nccl"  # CUDA tensors (libnccl.so.2 through ctypes)


class TransportError(RuntimeError):
    """A channel operation failed (peer died, timeout, frame mismatch (order, tag, size), closed).

    The channel is broken afterwards: every pending and later op fails with this error.
    """


class TransportUnavailable(TransportError):
    """This transport cannot work in this process (e.g. NCCL without a CUDA device)."""


class TransferCancelled(RuntimeError):
    """The peer cancelled this op with :meth:`KVChannel.send_cancel`.

    Not a :class:`TransportError`: the channel stays healthy and in order.
    """


class KVChannel(ABC):
    """One end of a 2-rank channel. Thread-safe: any thread may call any method.

    Attributes:
        kind: which transport carries the bytes.
        rank: 0 on the sender side (prefill worker, hosts the rendezvous), 1 on the
            receiver side (decode worker).
        timeout_s: the longest any single op (one tensor) may take once it reaches the
            channel's thread; past it the op fails and the channel breaks. Queue time before
            that does not count, so pick it above the largest transfer's wire time.

    Futures are not cancellable (``cancel()`` returns False): an op once submitted is part
    of the order both ranks agreed on. Done-callbacks run on the channel's thread; keep
    them short and never block in them on another op of the same channel.
    """

    kind: TransportKind
    rank: int
    timeout_s: float

    @abstractmethod
    def send(self, tensor: torch.Tensor, tag: int = 0) -> Future[None]:
        """Queue ``tensor`` (contiguous) for sending, framed with ``tag`` (an int64 naming
        what the op is for); ops run strictly in call order.

        The caller must not modify ``tensor`` until the future is done. Invalid arguments
        raise ``ValueError`` here; wire failures fail the future with TransportError.
        """

    @abstractmethod
    def recv(self, tensor: torch.Tensor, tag: int = 0) -> Future[None]:
        """Queue a receive into ``tensor`` (contiguous, filled in place), in call order.

        The peer's matching send must carry the same ``tag`` and exactly as many bytes as
        ``tensor``; otherwise the op fails with TransportError and the channel breaks (the
        frame is checked before the op completes; the tensor's contents are then
        unspecified and must not be used). If the peer sent a cancel marker instead, the
        future fails with :class:`TransferCancelled` (contents unspecified) and the channel
        stays usable.
        """

    @abstractmethod
    def send_cancel(self, tag: int = 0) -> Future[None]:
        """Occupy the next send slot with a cancel marker (framed with ``tag``) instead of a tensor.

        For a transfer the control plane announced but the sender cannot deliver: the
        peer's matching recv fails with :class:`TransferCancelled`, and the order on both
        sides stays intact.
        """

    @property
    @abstractmethod
    def broken(self) -> bool:
        """True once the channel carries no more ops: after any failure, or after close()."""

    @property
    @abstractmethod
    def failure(self) -> str | None:
        """Why the channel broke (its first failure), or None (healthy, or merely closed)."""

    @abstractmethod
    def close(self) -> None:
        """Idempotent. Fails pending futures with TransportError and stops the threads.

        Returns promptly; an op already on the wire is abandoned (its future has failed)
        and its thread exits when the transport lets go of it (at most ``timeout_s``).
        """

    @abstractmethod
    def join(self, timeout: float | None = None) -> bool:
        """After close(): wait up to ``timeout`` seconds for the channel's threads to exit.
        True when they have, i.e. the transport no longer touches any tensor passed in."""

    def __enter__(self) -> KVChannel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
