"""The standard health service, except that its Watch streams end once the
daemon begins to drain (after telling NOT_SERVING). A stream left open
would hold the server's stop for its whole grace; cpcache's blocking client
keeps one open while it steps (`Client._keep_event_thread`). Its Watch is the
stock one's loop, on the stock servicer's fields: tests/daemon/test_graceful_stop.py
holds it to the installed grpc_health."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2


class DrainingHealth(health_async.HealthServicer):
    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        # The stock loop (grpc_health's _async.py), which never ends, plus its end.
        condition = self._server_watchers[request.service]
        self._watcher_count_by_service[request.service] += 1
        last_status = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(request.service,
                                                     health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last_status:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last_status = status
                    if self._gracefully_shutting_down:
                        return
                    await condition.wait()
        finally:
            self._watcher_count_by_service[request.service] -= 1
            if self._watcher_count_by_service[request.service] == 0:
                del self._server_watchers[request.service]
                del self._watcher_count_by_service[request.service]

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        # A watch whose service never had its status set was not woken by it.
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()
