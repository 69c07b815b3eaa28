"""KV transport: 2-rank channels that carry packed KV pages from a prefill worker to a
decode worker, and the per-transfer state machine.

Kept light: importing this package imports neither torch nor NCCL. The concrete channels
live in ``engine.transport.gloo`` (CPU, TCP) and ``engine.transport.nccl`` (CUDA).
"""

from engine.transport.base import (
    KVChannel,
    TransferCancelled,
    TransportError,
    TransportKind,
    TransportUnavailable,
)
from engine.transport.transfer import InvalidTransition, Transfer, TransferState

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
