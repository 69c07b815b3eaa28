"""What the registry accepts from a worker: its identity and load reports are checked, not
trusted (defence in depth under mTLS, and the only defence without it).

* ``incarnation`` must be set; heartbeats count only for the registered (worker id,
  incarnation) pair, and neither id is guessable (``plumbing.identity``), so a forged
  heartbeat (say, DRAINING) for a real worker is answered ``known=False`` and changes nothing.
* A load report is a set of gauges over one KV pool: ``kv_blocks_total`` >= 1 and fixed for
  an incarnation (a pool does not change size while its process lives); ``kv_blocks_free``
  and ``kv_blocks_in_transfer`` <= ``kv_blocks_total`` (so KV pressure stays in [0, 1] and
  nobody can claim negative load); queue gauges below ``MAX_GAUGE``. ``WorkerLoad`` carries
  no counters or rates today; any added must be checked here (counters monotone within an
  incarnation, rates bounded).
* ``state`` must be a known ``WorkerState``.
* ``kv_events`` (KV-aware routing): at most the batch size the gateway asked for, every hash
  16 bytes, none twice; the prefix index then checks that the worker claims no more cached
  blocks than its pool has (``gateway/prefix_index.py``).

Every violation is a ``ValueError`` naming the field (INVALID_ARGUMENT). A heartbeat that
fails validation does not refresh the worker, so one that keeps reporting nonsense is dropped
like a silent one.
"""

from __future__ import annotations

from engine.block_hash import BLOCK_HASH_BYTES
from splitserve_api.v1 import common_pb2, gateway_pb2

MAX_GAUGE = 1 << 40  # queue gauges (requests, prompt tokens) above this are not believed
_STATES = (common_pb2.WORKER_STATE_UNSPECIFIED, common_pb2.WORKER_STATE_SERVING,
           common_pb2.WORKER_STATE_DRAINING)


QUANTIZATIONS = ("none", "int8", "int4-g32", "int4-g64", "int4-g128")


def check_quantization(quantization: str, field: str) -> str:
    """A registration's weight quantization (unset: "none"); ValueError naming ``field``."""
    value = quantization or "none"
    if value not in QUANTIZATIONS:
        raise ValueError(f"{field} must be one of {QUANTIZATIONS}, got {quantization[:32]!r}")
    return value


def check_load(load: common_pb2.WorkerLoad, field: str, kv_blocks_total: int | None = None) -> None:
    """Raise ValueError naming ``field.<gauge>`` when ``load`` cannot be true; with
    ``kv_blocks_total``, the pool must still have that size."""
    if load.kv_blocks_total < 1:
        raise ValueError(f"{field}.kv_blocks_total must be >= 1, got {load.kv_blocks_total}")
    if kv_blocks_total is not None and load.kv_blocks_total != kv_blocks_total:
        raise ValueError(f"{field}.kv_blocks_total changed from {kv_blocks_total} to {load.kv_blocks_total} "
                         "within one incarnation")
    for name in ("kv_blocks_free", "kv_blocks_in_transfer"):
        if getattr(load, name) > load.kv_blocks_total:
            raise ValueError(f"{field}.{name} must be <= kv_blocks_total ({load.kv_blocks_total}), "
                             f"got {getattr(load, name)}")
    for name in ("num_running", "num_waiting", "num_queued_prefill_tokens"):
        if getattr(load, name) > MAX_GAUGE:
            raise ValueError(f"{field}.{name} must be <= {MAX_GAUGE}, got {getattr(load, name)}")


def check_state(state: int) -> int:
    """The state to record (unset reads as SERVING); ValueError for an unknown value."""
    if state not in _STATES:
        raise ValueError(f"state must be a WorkerState, got {state}")
    return state or common_pb2.WORKER_STATE_SERVING


def check_kv_events(events: gateway_pb2.KVEvents, field: str, max_per_beat: int) -> None:
    """ValueError naming ``field.<list>`` unless ``events`` is well formed: at most
    ``max_per_beat`` hashes in all (0: none are wanted), each ``BLOCK_HASH_BYTES`` long, none
    listed twice."""
    num_events = len(events.stored) + len(events.removed)
    if num_events > max_per_beat:
        raise ValueError(f"{field} carries {num_events} hashes; this gateway takes at most {max_per_beat} "
                         "per heartbeat (kv_events_max_per_beat)")
    for name in ("stored", "removed"):
        if any(len(h) != BLOCK_HASH_BYTES for h in getattr(events, name)):
            raise ValueError(f"{field}.{name}: every block hash must be {BLOCK_HASH_BYTES} bytes")
    if len({*events.stored, *events.removed}) != num_events:
        raise ValueError(f"{field}: a block hash is listed twice (each hash once, with its state now)")
