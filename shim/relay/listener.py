"""The relay's listening socket and the state shared by its connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Awaitable, Callable, ContextManager, Mapping

from .. import logs
from ..methods import Cardinality, cardinality
from ..proxy import Call, Handler
from ..upstream import Upstream
from .connection import ClientConnection, LocalContext

_log = logs.get("relay")

Send = Callable[[bytes], Awaitable[None]]


class Relay:
    """Accepts CRI clients on a unix socket; one runtime connection per client connection."""

    def __init__(self, upstream_path: str, upstream: Upstream, table: Callable[[], Mapping[str, Handler]],
                 max_message_bytes: int, observe: Callable[[Call], ContextManager[Call]] | None = None) -> None:
        self.upstream_path = upstream_path
        self.upstream = upstream  # grpc channel for the handlers' own calls
        self._table = table
        self._observe = observe or contextlib.nullcontext  # span and rpc duration (Proxy.observe)
        self.max_message_bytes = max_message_bytes
        self.connections: set[ClientConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._probe: asyncio.Task[None] | None = None
        self._reachable: bool | None = None

    @property
    def table(self) -> Mapping[str, Handler]:
        return self._table()

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: ClientConnection(self), path)

    async def serve(self, method: str, handler: Any, request: bytes, ctx: LocalContext, send: Send) -> None:
        call = Call(method, ctx.md, ctx.time_remaining(), ctx, self.upstream)  # type: ignore[arg-type]
        with self._observe(call):
            if cardinality(method) is Cardinality.SERVER_STREAM:
                async for msg in handler(request, call):
                    await send(msg)
            else:
                await send(await handler(request, call))

    # ------------------------------------------------------------------ runtime reachability

    def upstream_unreachable(self, err: Exception | None) -> None:
        if self._reachable is not False:
            self._reachable = False
            logs.log(_log, logging.WARNING, "runtime not reachable", path=self.upstream_path,
                     error=str(err) if err else "connection closed")

    def upstream_reachable(self) -> None:
        if self._reachable is not True:
            if self._reachable is False:
                logs.log(_log, logging.INFO, "runtime reachable again", path=self.upstream_path)
            self._reachable = True

    def watch_for_upstream(self, conn: ClientConnection) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._wait_for_upstream(), name="runtime-probe")

    async def _wait_for_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.25)
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_unix_connection(asyncio.Protocol, self.upstream_path), 1.0)
            except (OSError, asyncio.TimeoutError):
                continue
            transport.close()
            self.upstream_reachable()
            for c in list(self.connections):
                c.runtime_back()
            return

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self, grace: float) -> None:
        """Stop accepting; GOAWAY every client; wait for in-flight calls up to ``grace``."""
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c.busy for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.connections):
            c.abort()
        if self._probe is not None:
            self._probe.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
