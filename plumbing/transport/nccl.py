"""NCCL KV channel: CUDA tensors over a 2-rank NCCL communicator (libnccl.so.2 via ctypes).

Handshake: rank 0 calls ``NcclLibrary().get_unique_id()`` and sends the 128 bytes to the
peer; both sides construct ``NcclChannel(unique_id, rank)`` (blocking until both joined,
so from a thread of their own).

Data moves one way, rank 0 → rank 1 (prefill → decode): NCCL runs all of a communicator's
kernels in one order, so sends from both ranks at once could deadlock; ``send`` is for
rank 0 and ``recv`` for rank 1 (ValueError otherwise).

Streams: every NCCL call is enqueued on the channel's own CUDA stream. At ``send``/``recv``
call time an event is recorded on the caller's current stream, and the channel's stream
waits for it, so the op sees the caller's earlier kernels (e.g. ``pack_kv``). A future
completes once the host has seen the op's completion event, so after ``result()`` the
tensor may be reused (send) or read by any stream (recv).

Deadlines: the communicator is non-blocking; the sender/receiver thread polls the
completion event and ``ncclCommGetAsyncError`` with back-off (20 µs .. 1 ms) until the op
is done, the peer failed, close() was called, or ``timeout_s`` passed. Any failure aborts
the communicator (``ncclCommAbort``), which also stops kernels stuck waiting on a dead peer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import structlog
import torch

from plumbing.transport.base import (
    TransferCancelled,
    TransportError,
    TransportKind,
    TransportUnavailable,
)
from plumbing.transport.framed import (
    FRAME_NUMEL,
    FramedChannel,
    check_frame,
    check_timeout,
    frame_nbytes,
)
from plumbing.transport.nccl_lib import (
    IN_PROGRESS,
    SUCCESS,
    UNIQUE_ID_BYTES,
    NcclLibrary,
    find_nccl_library,
    nccl_datatype,
)

logger = structlog.get_logger(__name__)

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def _resolve_device(device: torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    if device.type != "cuda":
        raise ValueError(f"NcclChannel needs a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _poll(is_done: Callable[[], bool], deadline: float, what: str, timeout_s: float,
          stop: threading.Event | None = None) -> None:
    """Call ``is_done`` with back-off until it returns True (it may raise); TransportError
    when ``deadline`` (time.monotonic) passes or ``stop`` is set."""
    delay = _POLL_MIN_S
    while not is_done():
        if stop is not None and stop.is_set():
            raise TransportError(f"channel closed while waiting for {what}")
        if time.monotonic() > deadline:
            raise TransportError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


class NcclChannel(FramedChannel):
    """A :class:`~plumbing.transport.base.KVChannel` over a non-blocking NCCL communicator."""

    kind = TransportKind.NCCL

    def __init__(
        self,
        unique_id: bytes,
        rank: int,
        device: torch.device | int | None = None,
        timeout_s: float = 30.0,
        library: NcclLibrary | None = None,
    ) -> None:
        """Blocks until both ranks joined (up to ``timeout_s``). ``library`` defaults to
        :func:`find_nccl_library`'s. Raises ValueError for bad arguments,
        TransportUnavailable when CUDA or a recent-enough NCCL is missing, and
        TransportError when the communicator cannot be formed."""
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != UNIQUE_ID_BYTES:
            got = len(unique_id) if isinstance(unique_id, (bytes, bytearray)) else type(unique_id)
            raise ValueError(f"unique_id must be {UNIQUE_ID_BYTES} bytes, got {got}")
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        check_timeout(timeout_s)
        if not torch.cuda.is_available():
            raise TransportUnavailable(
                "nccl transport needs a CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})"
            )
        self._device = _resolve_device(device)
        self._lib = library if library is not None else NcclLibrary()
        self._lib.require_non_blocking()
        self._peer = 1 - rank
        self._comm_lock = threading.Lock()  # serializes every NCCL call on _comm
        self._stream = torch.cuda.Stream(device=self._device)
        self._comm: int | None = self._init_comm(bytes(unique_id), rank, timeout_s)
        self._frame_buf = torch.empty(FRAME_NUMEL, dtype=torch.int64, device=self._device)
        super().__init__(rank, timeout_s)
        self._log.info("kv channel formed", device=str(self._device),
                       nccl=".".join(map(str, self._lib.version())))

    def _init_comm(self, unique_id: bytes, rank: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        with torch.cuda.device(self._device):
            comm, _ = self._lib.comm_init_rank(unique_id, rank)
            try:
                _poll(lambda: self._settled(comm), deadline,
                      f"rank {1 - rank} to join the nccl communicator", timeout_s)
            except TransportError:
                self._lib.comm_abort(comm)
                raise
        return comm

    # -- API: one direction only ---------------------------------------------------------

    def send_cancel(self, tag: int = 0) -> Future[None]:
        self._check_direction("send_cancel")
        return super().send_cancel(tag)

    def _check_direction(self, op: str) -> None:
        sender = op.startswith("send")
        if sender != (self.rank == 0):
            raise ValueError(
                f"NcclChannel carries data from rank 0 to rank 1; {op} on rank {self.rank}")

    def _check_tensor(self, tensor: torch.Tensor, op: str) -> None:
        super()._check_tensor(tensor, op)
        self._check_direction(op)
        if tensor.device != self._device:
            raise ValueError(f"NcclChannel on {self._device}; {op} got a tensor on {tensor.device}")

    def _prepare(self, tensor: torch.Tensor) -> object:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        return ready

    # -- wire primitives (sender / receiver thread) --------------------------------------

    def _transmit(self, seq: int, tensor: torch.Tensor | None, tag: int, ready: object) -> None:
        """Frame ``[seq, nbytes, tag]`` then the payload; NCCL needs no receive posted first
        (and has no tags: the frame, checked by the receiver first, carries ours)."""
        deadline = time.monotonic() + self.timeout_s
        nbytes = frame_nbytes(tensor)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            frame = torch.tensor([seq, nbytes, tag], dtype=torch.int64, device=self._device)
            self._p2p(self._lib.send, frame, deadline, "frame send")
            if tensor is not None and nbytes > 0:
                self._p2p(self._lib.send, tensor, deadline, "payload send")
            self._wait_stream(deadline, "send")

    def _receive(self, seq: int, tensor: torch.Tensor, tag: int, ready: object) -> None:
        """The frame first (to the host, checked: order, tag, size), then the payload into
        ``tensor``; a frame for another transfer breaks the channel before any payload moves."""
        deadline = time.monotonic() + self.timeout_s
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._p2p(self._lib.recv, self._frame_buf, deadline, "frame recv")
            self._wait_stream(deadline, "frame recv")
            frame_seq, nbytes, frame_tag = self._frame_buf.tolist()
            if check_frame(seq, (int(frame_seq), int(nbytes), int(frame_tag)), tensor, tag):
                raise TransferCancelled(f"peer cancelled op #{seq}")
            if nbytes > 0:
                self._stream.wait_event(ready)
                self._p2p(self._lib.recv, tensor, deadline, "payload recv")
                self._wait_stream(deadline, "payload recv")

    def _p2p(self, call: Callable[..., int], tensor: torch.Tensor, deadline: float,
             what: str) -> None:
        dtype, count = nccl_datatype(tensor.dtype, tensor.numel(), tensor.nbytes)
        with self._comm_lock:
            comm = self._require_comm()
            code = call(tensor.data_ptr(), count, dtype, self._peer, comm, self._stream.cuda_stream)
        if code == IN_PROGRESS:
            self._poll(self._comm_settled, deadline, what)

    def _wait_stream(self, deadline: float, what: str) -> None:
        done = torch.cuda.Event()
        done.record(self._stream)
        self._poll(lambda: self._event_done(done), deadline, what)

    def _event_done(self, event: torch.cuda.Event) -> bool:
        """True once ``event`` completed; raises if the communicator reports an error."""
        if event.query():
            return True
        with self._comm_lock:
            self._settled(self._require_comm())
        return False

    def _poll(self, is_done: Callable[[], bool], deadline: float, what: str) -> None:
        _poll(is_done, deadline, what, self.timeout_s, self._stop_requested)

    # -- communicator state --------------------------------------------------------------

    def _require_comm(self) -> int:  # caller holds _comm_lock
        if self._comm is None:
            raise TransportError("nccl communicator aborted or destroyed")
        return self._comm

    def _comm_settled(self) -> bool:
        """True when the communicator has no call in progress; raises on an async error."""
        with self._comm_lock:
            return self._settled(self._require_comm())

    def _settled(self, comm: int) -> bool:
        state = self._lib.comm_async_error(comm)
        if state not in (SUCCESS, IN_PROGRESS):
            self._lib.check(state, "nccl communicator", comm)
        return state == SUCCESS

    def _on_broken(self) -> None:
        self._abort()

    def _abort(self) -> None:
        with self._comm_lock:
            comm, self._comm = self._comm, None
            if comm is not None:
                try:
                    self._lib.comm_abort(comm)
                except TransportError as exc:
                    self._log.warning("ncclCommAbort failed", error=str(exc))

    def _teardown(self, clean: bool) -> None:
        if not clean:
            self._abort()
            return
        with self._comm_lock:
            comm, self._comm = self._comm, None
        if comm is None:
            return
        try:
            self._lib.comm_finalize(comm)
            _poll(lambda: self._settled(comm), time.monotonic() + self.timeout_s,
                  "ncclCommFinalize", self.timeout_s)
            self._lib.comm_destroy(comm)
        except TransportError as exc:
            self._log.warning("nccl finalize failed; aborting", error=str(exc))
            self._lib.comm_abort(comm)


__all__ = ["NcclChannel", "NcclLibrary", "find_nccl_library"]
