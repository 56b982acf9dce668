"""The metrics endpoint: a small HTTP/1.1 server on the daemon's event
loop, bounded like every listener (`budget`).

prometheus_client's own server starts a thread per connection and never
times out an idle one, so a thousand idle connections (no authentication,
and `metrics_address` may face the network) took every descriptor of the
daemon. Here: at most METRICS_CONNECTIONS at once (a new one closes the
oldest that has not sent its request yet, or is closed itself), a request
head read within METRICS_READ_S and METRICS_REQUEST_BYTES or the connection
is closed, the answer written within the same time, one answer per
connection. At most METRICS_PER_SOURCE of the connections come from one
address (a new one closes that address's oldest idle one, or itself), so
one peer cannot hold every place. Exposition is formatted on one thread of
its own and kept METRICS_CACHE_S: every scrape in that time is answered
from it, and scrapes waiting on a formatting share it, so a scrape storm
costs one formatting a second; the values come from the loop as before
(`DaemonCollector`).

It serves `GET /metrics` (and `/`): counters and gauges of this rank,
per-RPC counts and latencies, and the process's own (descriptors, memory,
CPU). Nothing a client sent: no model ids, keys, tokens or paths.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cpcache.daemon import budget

log = logging.getLogger("cpcached")


class MetricsServer:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._open: set[asyncio.WriteTransport] = set()
        # Connections still reading their request, oldest first.
        self._reading: collections.OrderedDict[asyncio.WriteTransport, None] = collections.OrderedDict()
        self._source: dict[asyncio.WriteTransport, str] = {}  # each open connection's peer address
        self._cached: tuple[float, bytes] | None = None  # (loop time formatted, body)
        self._formatting: asyncio.Future[bytes] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._formatter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="metrics")
        self.refused = 0  # connections closed unread: the limit was reached
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: any free one); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=budget.METRICS_REQUEST_BYTES,
                                                  backlog=budget.METRICS_BACKLOG)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._formatter.shutdown(wait=False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        source = str((transport.get_extra_info("peername") or ("",))[0])
        mine = [t for t in self._open if self._source.get(t) == source]
        if len(mine) >= budget.METRICS_PER_SOURCE and not self._make_room(set(mine)):
            return self._refuse(transport)
        if len(self._open) >= budget.METRICS_CONNECTIONS and not self._make_room(self._open):
            return self._refuse(transport)
        self._open.add(transport)
        self._source[transport] = source
        self._reading[transport] = None
        try:
            await asyncio.wait_for(self._answer(reader, writer), budget.METRICS_READ_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError):
            pass  # idle, too long, gone, evicted or garbled: the connection just ends
        except Exception:  # formatting failed: the scrape fails, the daemon goes on
            log.warning("metrics: a scrape failed", exc_info=True)
        finally:
            self._open.discard(transport)
            self._source.pop(transport, None)
            self._reading.pop(transport, None)
            transport.abort()

    def _make_room(self, among: set[asyncio.WriteTransport]) -> bool:
        """Close the oldest of `among` that has not sent its request yet
        (idle ones cannot keep a real scraper out); False if each is
        answering a scrape."""
        oldest = next((t for t in self._reading if t in among), None)
        if oldest is None:
            return False
        del self._reading[oldest]
        self._open.discard(oldest)
        self._source.pop(oldest, None)
        oldest.abort()
        self.refused += 1
        return True

    def _refuse(self, transport: asyncio.WriteTransport) -> None:
        self.refused += 1
        transport.abort()

    async def _body(self) -> bytes:
        """The exposition, formatted at most every METRICS_CACHE_S; scrapes
        that come while it is formatted wait for that same one."""
        loop = asyncio.get_running_loop()
        if self._cached is not None and loop.time() - self._cached[0] < budget.METRICS_CACHE_S:
            return self._cached[1]
        if self._formatting is None:
            self._formatting = asyncio.ensure_future(self._format())
        # Shielded: a scrape that times out must not cancel the others' formatting.
        return await asyncio.shield(self._formatting)

    async def _format(self) -> bytes:
        loop = asyncio.get_running_loop()
        try:
            body = await loop.run_in_executor(self._formatter, generate_latest, self._registry)
            self._cached = (loop.time(), body)
            return body
        finally:
            self._formatting = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self._reading.pop(writer.transport, None)
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            status, body = "405 Method Not Allowed", b"GET /metrics\n"
        elif path not in ("/metrics", "/"):
            status, body = "404 Not Found", b"GET /metrics\n"
        else:
            status, body = "200 OK", await self._body()
        content_type = CONTENT_TYPE_LATEST if status == "200 OK" else "text/plain; charset=utf-8"
        writer.write((f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                      "Connection: close\r\n\r\n").encode("latin-1"))
        if method != "HEAD":
            writer.write(body)
        await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
