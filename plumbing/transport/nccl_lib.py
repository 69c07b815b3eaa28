"""A ctypes binding to the few ``libnccl.so.2`` entry points the NCCL channel needs.

The library comes from the ``nvidia-nccl-cu12`` wheel (``nvidia/nccl/lib/libnccl.so.2``).
It loads on a machine without a GPU: ``ncclGetVersion`` and ``ncclGetUniqueId`` work there;
creating a communicator needs CUDA. Nothing here is loaded at import time.

Communicators are created *non-blocking* (``ncclConfig_t.blocking = 0``, NCCL >= 2.14) so
that every wait can have a deadline: a call may return ``IN_PROGRESS`` and the caller polls
``comm_async_error`` until it settles, and ``ncclCommAbort`` unblocks a stuck communicator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from pathlib import Path

import torch

from plumbing.transport.base import TransportError, TransportUnavailable

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
ENV_LIBRARY = "SPLITSERVE_NCCL_LIBRARY"

# ncclResult_t
SUCCESS = 0
IN_PROGRESS = 7

# ncclDataType_t. Dtypes not listed travel as bytes (ncclUint8).
NCCL_UINT8 = 1
_NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}

_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # the ncclConfig_t layout below is NCCL 2.14's
_MIN_VERSION = (2, 14, 0)  # ncclCommInitRankConfig / non-blocking communicators


def nccl_datatype(dtype: torch.dtype, numel: int, nbytes: int) -> tuple[int, int]:
    """``(ncclDataType_t, count)`` that carries a tensor of ``dtype``: native when NCCL has
    the type, else ``nbytes`` bytes as ncclUint8."""
    if dtype in _NCCL_DTYPES:
        return _NCCL_DTYPES[dtype], numel
    return NCCL_UINT8, nbytes


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


class CommConfig(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.14. Newer libraries read ``size``/``version`` and take
    defaults for every field they added later."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]

    @classmethod
    def non_blocking(cls) -> CommConfig:
        return cls(ctypes.sizeof(cls), _CONFIG_MAGIC, _CONFIG_VERSION, 0)


def find_nccl_library() -> str:
    """Path (or soname) of libnccl.so.2: ``$SPLITSERVE_NCCL_LIBRARY``, else the
    nvidia-nccl-cu12 wheel's copy, else the system's. TransportUnavailable if none."""
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        if not Path(explicit).is_file():
            raise TransportUnavailable(f"{ENV_LIBRARY}={explicit!r} is not a file")
        return explicit
    for directory in _wheel_dirs():
        candidate = directory / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return str(candidate)
    system = ctypes.util.find_library("nccl")
    if system:
        return system
    raise TransportUnavailable(
        "libnccl.so.2 not found: install nvidia-nccl-cu12 (pip install 'splitserve[gpu]') "
        f"or set {ENV_LIBRARY} to the library's path"
    )


def _wheel_dirs() -> list[Path]:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _decode_version(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE: major*1000 + minor*100 + patch before 2.9,
    major*10000 + minor*100 + patch since."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


class NcclLibrary:
    """A loaded libnccl. Thread-safe to share; the communicator calls are not (callers
    serialize per communicator)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else find_nccl_library()
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise TransportUnavailable(f"cannot load NCCL library {self.path!r}: {exc}") from exc
        self._bind()

    def _bind(self) -> None:
        lib, c_int, ptr = self._lib, ctypes.c_int, ctypes.c_void_p
        self._sig("ncclGetVersion", [ctypes.POINTER(c_int)])
        self._sig("ncclGetUniqueId", [ctypes.POINTER(UniqueId)])
        lib.ncclGetErrorString.argtypes = [c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        self._sig("ncclCommInitRankConfig",
                  [ctypes.POINTER(ptr), c_int, UniqueId, c_int, ctypes.POINTER(CommConfig)],
                  optional=True)
        self._sig("ncclCommGetAsyncError", [ptr, ctypes.POINTER(c_int)])
        self._sig("ncclCommFinalize", [ptr], optional=True)
        self._sig("ncclCommDestroy", [ptr])
        self._sig("ncclCommAbort", [ptr])
        # buf, count, dtype, peer, comm, stream
        p2p = [ptr, ctypes.c_size_t, c_int, c_int, ptr, ptr]
        self._sig("ncclSend", p2p)
        self._sig("ncclRecv", p2p)
        if hasattr(lib, "ncclGetLastError"):
            lib.ncclGetLastError.argtypes = [ptr]
            lib.ncclGetLastError.restype = ctypes.c_char_p

    def _sig(self, name: str, argtypes: list, optional: bool = False) -> None:
        if optional and not hasattr(self._lib, name):
            return
        fn = getattr(self._lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int

    # -- identity ------------------------------------------------------------------------

    def version(self) -> tuple[int, int, int]:
        code = ctypes.c_int()
        self.check(self._lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
        return _decode_version(code.value)

    def get_unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes; rank 0 makes it, the handshake carries it)."""
        uid = UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def error_string(self, code: int) -> str:
        return self._lib.ncclGetErrorString(code).decode(errors="replace")

    def check(self, code: int, what: str, comm: int | None = None) -> int:
        """Return ``code`` if SUCCESS/IN_PROGRESS, else raise TransportError naming it."""
        if code in (SUCCESS, IN_PROGRESS):
            return code
        detail = ""
        if comm is not None and hasattr(self._lib, "ncclGetLastError"):
            last = self._lib.ncclGetLastError(comm)
            detail = f" ({last.decode(errors='replace')})" if last else ""
        raise TransportError(f"{what} failed: {self.error_string(code)} [{code}]{detail}")

    def require_non_blocking(self) -> None:
        version = self.version()
        if version < _MIN_VERSION or not hasattr(self._lib, "ncclCommInitRankConfig"):
            raise TransportUnavailable(
                f"NCCL {'.'.join(map(str, version))} at {self.path} is too old: "
                f"the nccl transport needs >= {'.'.join(map(str, _MIN_VERSION))}"
            )

    # -- communicator (non-blocking; each returns SUCCESS or IN_PROGRESS) ----------------

    def comm_init_rank(self, unique_id: bytes, rank: int, nranks: int = 2) -> tuple[int, int]:
        """Start creating a communicator on the current CUDA device: ``(comm, code)``."""
        comm = ctypes.c_void_p()
        uid = UniqueId()
        ctypes.memmove(ctypes.byref(uid), unique_id, UNIQUE_ID_BYTES)
        config = CommConfig.non_blocking()
        code = self._lib.ncclCommInitRankConfig(ctypes.byref(comm), nranks, uid, rank,
                                                ctypes.byref(config))
        if code not in (SUCCESS, IN_PROGRESS):
            if comm.value:
                self._lib.ncclCommAbort(comm)
            self.check(code, "ncclCommInitRankConfig")
        if not comm.value:
            raise TransportError("ncclCommInitRankConfig returned no communicator")
        return comm.value, code

    def comm_async_error(self, comm: int) -> int:
        """The communicator's state: SUCCESS, IN_PROGRESS, or an error code."""
        state = ctypes.c_int()
        self.check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(state)),
                   "ncclCommGetAsyncError")
        return state.value

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        code = self._lib.ncclSend(buf, count, dtype, peer, comm, stream)
        return self.check(code, "ncclSend", comm)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        code = self._lib.ncclRecv(buf, count, dtype, peer, comm, stream)
        return self.check(code, "ncclRecv", comm)

    def comm_finalize(self, comm: int) -> int:
        if not hasattr(self._lib, "ncclCommFinalize"):
            return SUCCESS
        return self.check(self._lib.ncclCommFinalize(comm), "ncclCommFinalize", comm)

    def comm_destroy(self, comm: int) -> None:
        self.check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def comm_abort(self, comm: int) -> None:
        self.check(self._lib.ncclCommAbort(comm), "ncclCommAbort")


def bootstrap_host(unique_id: bytes) -> str | None:
    """The IP address rank 1 dials to join the communicator ``unique_id`` names (its
    bootstrap root, rank 0's host), or None when the id does not hold one we can read.

    An ncclUniqueId is ``ncclBootstrapHandle {uint64 magic; sockaddr_in/_in6 addr}`` (NCCL
    >= 2.12): bytes 8-9 the address family (host order), 10-11 the port, then the address.
    """
    import socket
    import struct

    if len(unique_id) != UNIQUE_ID_BYTES:
        return None
    family = struct.unpack_from("<H", unique_id, 8)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, unique_id[12:16])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, unique_id[16:32])  # after flowinfo
    return None
