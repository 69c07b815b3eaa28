"""KV transport: 2-rank channels that carry packed KV pages from a prefill worker to a
decode worker, and the per-transfer state machine.

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
from plumbing.transport.transfer import InvalidTransition, Transfer, TransferState

__all__ = [
    "InvalidTransition",
    "KVChannel",
    "Transfer",
    "TransferCancelled",
    "TransferState",
    "TransportError",
    "TransportKind",
    "TransportUnavailable",
]
