"""Keeping the decode worker's reservation alive while this worker computes its pages (#25).

The gateway opens the decode leg first: the decode worker reserves blocks under a lease
(``lease_ms``), then the prompt reaches this worker, where it may wait behind others. Left
alone, a lease shorter than that wait runs out and the prefill's work is thrown away. So
from the moment ``Prefill`` starts until its pages are sent, this worker renews the lease
on the RPC channel it already holds to that decode worker::

    Prefill starts ──RenewLease──▶ lease_ms_left
        every third of it, if this worker made progress since the last renewal
        (an engine step or a finished transfer) ──RenewLease──▶ …
    pages sent (or the call ends) ─▶ stop          NOT_FOUND / FAILED_PRECONDITION ─▶ stop
                                                    lease_ms_left 0 (pages written) ─▶ stop

Bounds: the decode worker caps one reservation's total hold (``--max-reservation-hold-ms``);
a worker that dies or stalls stops renewing, so the lease runs out one lease after its last
renewal, as before; a transient failure (UNAVAILABLE) is tried again at the next tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from splitserve_api.v1 import decode_pb2_grpc, kv_transfer_pb2, prefill_pb2

log = structlog.get_logger()
MIN_INTERVAL_S = 0.01  # never renew more often than this
RETRY_INTERVAL_S = 0.5  # after a transient failure, before the lease length is known
_FINAL = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.UNIMPLEMENTED)


async def keep_lease(stub: Callable[[], decode_pb2_grpc.DecodeWorkerStub], target: prefill_pb2.DecodeTarget,
                     progress: Callable[[], int], timeout_s: float) -> int:
    """Renew ``target``'s lease until cancelled, the lease no longer applies, or the decode
    worker says it ended; a renewal is skipped when ``progress()`` has not moved since the
    last one. Returns the number of renewals granted."""
    renewal = kv_transfer_pb2.LeaseRenewal(transfer_id=target.transfer_id, transfer_secret=target.transfer_secret,
                                           decode_incarnation=target.incarnation)
    interval = RETRY_INTERVAL_S
    seen: int | None = None
    num_granted = 0
    while True:
        mark = progress()
        if mark != seen:  # a failed renewal leaves ``seen`` as it was: tried again at the next tick
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
                seen = mark
                num_granted += 1
                interval = max(grant.lease_ms_left / 3000.0, MIN_INTERVAL_S)
        await asyncio.sleep(interval)
