"""KV transport: 2-rank channels that carry packed KV pages from a prefill worker to a
decode worker. (A hand-off's state machine is the decode worker's ``Reservation``.)

Kept light: importing this package imports neither torch nor NCCL. The concrete channels
live in ``plumbing.transport.gloo`` (CPU, TCP) and ``plumbing.transport.nccl`` (CUDA).
"""

from plumbing.transport.base import (
    KVChannel,
    TransferCancelled,
    TransportError,
    TransportKind,
    TransportUnavailable,
)

__all__ = [
    "KVChannel",
    "TransferCancelled",
    "TransportError",
    "TransportKind",
    "TransportUnavailable",
]
