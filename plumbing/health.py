"""``grpc.health.v1`` for a service whose servers drain: one servicer across all its ports.

The reference asyncio servicer keeps every ``Watch`` stream open forever, so a watcher (a
load balancer, a mesh sidecar) held a draining process until ``--drain-timeout-s`` ran out.
``DrainingHealthServicer.end_watches`` ends them (status OK, after they have seen
NOT_SERVING): the server can close as soon as the real work is done.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DrainingHealthServicer(health.aio.HealthServicer):
    """The reference servicer, whose ``Watch`` streams end when ``end_watches`` is called."""

    def __init__(self) -> None:
        super().__init__()
        self._watches_ended = False

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        condition = self._server_watchers[request.service]
        self._watcher_count_by_service[request.service] += 1
        last_status = None
        try:
            async with condition:
                while not self._watches_ended:
                    status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last_status:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last_status = status
                    await condition.wait()
        finally:
            self._watcher_count_by_service[request.service] -= 1
            if self._watcher_count_by_service[request.service] == 0:
                del self._server_watchers[request.service]
                del self._watcher_count_by_service[request.service]

    async def set_all(self, names: list[str], serving: bool) -> None:
        """The whole server ("") and every named service SERVING or NOT_SERVING."""
        for name in ["", *names]:
            await self.set(name, SERVING if serving else NOT_SERVING)

    async def end_watches(self) -> None:
        """Every ``Watch`` stream, open now or later, ends once it has sent the last status."""
        self._watches_ended = True
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()
