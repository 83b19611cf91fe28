"""The /metrics endpoint, served on the shim's event loop (no thread per connection).

Bounds (README "Limits"): at most ``metrics.max_connections`` connections at once; at
the cap, a new connection closes the oldest one still sending its request (so a scraper
gets in however many half-sent requests are open), and is closed itself only when every
open connection is being answered. A connection that has not sent its request head (at
most MAX_HEAD_BYTES) and read its answer within ``metrics.timeout_seconds`` is closed.
One request per connection (``Connection: close``). ``GET`` (or ``HEAD``) of any path answers
the Prometheus text format, as prometheus_client's own server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from . import logs

MAX_HEAD_BYTES = 8192
_log = logs.get("metrics")


class MetricsServer:
    def __init__(self, render: Callable[[], tuple[bytes, str]], max_connections: int, timeout: float) -> None:
        self._render = render  # -> (body, content type)
        self.max_connections = max_connections
        self.timeout = timeout
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.StreamWriter, bool] = {}  # oldest first -> being answered
        self.refused = 0  # connections closed unanswered because max_connections were being answered
        self.evicted = 0  # connections closed while sending their request, to make room

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self, host: str, port: int) -> None:
        """OSError when the address cannot be bound."""
        self._server = await asyncio.start_server(self._serve, host or None, port, limit=MAX_HEAD_BYTES)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            oldest = next((w for w, answering in self._connections.items() if not answering), None)
            if oldest is None:
                self.refused += 1
                logs.log(_log, logging.WARNING, "metrics connection refused: metrics.max_connections reached",
                         max_connections=self.max_connections)
                writer.transport.abort()
                return
            self.evicted += 1
            del self._connections[oldest]
            oldest.transport.abort()
        self._connections[writer] = False
        try:
            async with asyncio.timeout(self.timeout):
                await self._answer(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # slow, gone or oversized: closed below
        finally:
            self._connections.pop(writer, None)
            writer.transport.abort()  # a no-op when the answer went out and the connection closed

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if writer not in self._connections:
            return  # closed to make room meanwhile
        self._connections[writer] = True
        method = head.split(b" ", 1)[0]
        if method in (b"GET", b"HEAD"):
            body, content_type = self._render()
            status = b"200 OK"
        else:
            body, content_type, status = b"method not allowed\n", "text/plain", b"405 Method Not Allowed"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
        if method != b"HEAD":
            writer.write(body)
        writer.close()  # after what is buffered is sent
        await writer.wait_closed()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._connections.clear()
