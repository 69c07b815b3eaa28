"""Keeping the decode worker's reservation alive while this worker computes its pages (#25).

The gateway opens the decode leg first: the decode worker reserves blocks under a lease
(``lease_ms``), then the prompt reaches this worker, where it may wait behind others. Left
alone, a lease shorter than that wait runs out and the prefill's work is thrown away. So
from the moment ``Prefill`` starts until its pages are sent, this worker renews the lease
on the RPC channel it already holds to that decode worker::

    Prefill starts ──RenewLease──▶ lease_ms_left
        every third of it, unless this worker made no progress (no engine step, no
        transfer ending) for STALL_S ──RenewLease──▶ …
    pages sent (or the call ends) ─▶ stop          NOT_FOUND / FAILED_PRECONDITION ─▶ stop
                                                    lease_ms_left 0 (pages written) ─▶ stop

Bounds: the decode worker caps one reservation's total hold (``--max-reservation-hold-ms``);
a worker that dies, is stopped, or stalls (no progress for ``STALL_S``: one step of a
2,048-token batch on a loaded CPU takes many seconds, which is no stall) stops renewing, so
the lease runs out one lease after its last renewal, as before; a transient failure (UNAVAILABLE) is tried again at the next tick.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog

from splitserve_api.v1 import decode_pb2_grpc, kv_transfer_pb2, prefill_pb2

log = structlog.get_logger()
MIN_INTERVAL_S = 0.01  # never renew more often than this
RETRY_INTERVAL_S = 0.5  # after a transient failure, before the lease length is known
STALL_S = 60.0  # no engine step and no transfer ending for this long: a stalled worker renews nothing
_FINAL = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.UNIMPLEMENTED)


async def keep_lease(stub: Callable[[], decode_pb2_grpc.DecodeWorkerStub], target: prefill_pb2.DecodeTarget,
                     progress: Callable[[], int], timeout_s: float, stall_s: float = STALL_S) -> int:
    """Renew ``target``'s lease until cancelled, the lease no longer applies, or the decode
    worker says it ended; renewals stop while ``progress()`` has not moved for ``stall_s``
    (one engine step that long is a stall, not a busy machine) and resume if it moves again.
    Returns the number of renewals granted."""
    renewal = kv_transfer_pb2.LeaseRenewal(transfer_id=target.transfer_id, transfer_secret=target.transfer_secret,
                                           decode_incarnation=target.incarnation)
    interval = RETRY_INTERVAL_S
    last_mark, moved_at = progress(), time.monotonic()
    num_granted = 0
    while True:
        mark, now = progress(), time.monotonic()
        if mark != last_mark:
            last_mark, moved_at = mark, now
        if now - moved_at < stall_s:
            try:
                grant = await stub().RenewLease(renewal, timeout=min(timeout_s, max(3 * interval, 2.0)))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _FINAL:
                    log.info("prefill.lease_gone", transfer_id=target.transfer_id, code=exc.code().name)
                    return num_granted
                log.warning("prefill.lease_renewal_failed", transfer_id=target.transfer_id, code=exc.code().name)
            else:
                if not grant.lease_ms_left:
                    return num_granted  # the pages are all written: no lease applies
                num_granted += 1
                interval = max(grant.lease_ms_left / 3000.0, MIN_INTERVAL_S)
        await asyncio.sleep(interval)
