"""The relay's listening socket and the state shared by its connections.

Process-wide bounds: at most ``max_connections`` client connections (who makes room
at the cap, by peer uid: admission.py; logged), a listen backlog of ``listen_backlog``, and the
soft RLIMIT_NOFILE raised to the hard limit at start (a warning when it cannot
hold ``max_connections``: each client connection uses two descriptors, its own and
its runtime connection). Running out of descriptors anyway (EMFILE/ENFILE) is logged
as that, never as "runtime not reachable"; the listener goes on accepting once
descriptors are free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, cast

from ..config import ServerConfig
from ..cri.call import Call, Handler
from ..cri.deadline import Deadline
from ..cri.methods import Cardinality, cardinality
from ..cri.peer import Peer
from ..cri.routing import Intercept, Patch, Refusal, Router
from ..cri.upstream import Upstream
from ..errors import Metadata
from ..observability import logs
from .admission import Admission, Conn
from .connection import ClientConnection
from .host import FD_ERRNOS, Send
from .limits import Limits

_log = logs.get("relay")

FDS_PER_CONNECTION = 2
FDS_RESERVED = 64  # runtime channel, metrics, admin socket, logs, image-set watchers
LOG_EVERY_SECONDS = 10.0


class _RateLimited:
    """A warning logged at most every LOG_EVERY_SECONDS, with the count since the last one."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.last = -LOG_EVERY_SECONDS
        self.count = 0

    def __call__(self, **fields: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_SECONDS:
            logs.log(_log, logging.WARNING, self.message, times=self.count, **fields)
            self.last, self.count = now, 0


class Relay:
    """Accepts CRI clients on a unix socket; one runtime connection per client connection.

    The connections' ``Host`` (host.py). Every bound comes from ``server`` (shim/config.py).
    """

    def __init__(self, upstream_path: str, upstream: Upstream, router: Router[Handler], server: ServerConfig,
                 observe: Callable[[Call], AbstractContextManager[Call]] | None = None) -> None:
        self.upstream_path = upstream_path
        self.upstream = upstream  # grpc channel for the handlers' own calls
        self.router = router
        self._observe: Callable[[Call], AbstractContextManager[Call]] = observe or contextlib.nullcontext
        self.config = s = server
        self.limits = Limits.of(server)  # the pools are this listener's: shared by its connections
        self.connections: set[ClientConnection] = set()
        self.admission = Admission(s.max_connections, s.max_connections_per_uid)
        self._server: asyncio.AbstractServer | None = None
        self._probe: asyncio.Task[None] | None = None
        self._reachable: bool | None = None
        self._refused = _RateLimited("connection refused: server.max_connections reached")
        self._evicted = _RateLimited("closed a connection to make room: server.max_connections reached")
        self.stream_stalled = _RateLimited("ended an intercepted call: the client opens no flow-control window")
        self.answer_overdue = _RateLimited("ended an intercepted call: the runtime's frames on its connection "
                                           "waited behind its answer (relay/carried.py)")
        self._no_fds = _RateLimited("out of file descriptors")
        # a client breaking the protocol, logged at most every LOG_EVERY_SECONDS (with a count)
        self.protocol_error = _RateLimited("closing connection: HTTP/2 protocol error")
        self.stream_refused = _RateLimited("stream refused (REFUSED_STREAM, the client retries it): "
                                           "server.max_concurrent_streams reached on its connection")

    def route(self, path: str) -> Intercept[Handler] | Patch[Handler] | Refusal | None:
        return self.router.route(path)

    async def start(self, path: str) -> None:
        self._raise_fd_limit()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: ClientConnection(self), path,
                                                     backlog=self.config.listen_backlog)

    def _raise_fd_limit(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
        need = self.config.max_connections * FDS_PER_CONNECTION + FDS_RESERVED
        if soft != resource.RLIM_INFINITY and soft < need:
            logs.log(_log, logging.WARNING, "file descriptor limit below what server.max_connections needs",
                     limit=soft, needed=need, max_connections=self.config.max_connections,
                     hint="raise LimitNOFILE in the unit or lower server.max_connections")

    def admit(self, conn: Conn) -> bool:
        """Count a new client connection in, making room first if needed (admission.py)."""
        ok, victim, key = self.admission.room_for(conn)
        if not ok:
            self._refused(uid=conn.peer.uid, pid=conn.peer.pid, max_connections=self.config.max_connections,
                          key=key)
            return False
        if victim is not None:
            self._evicted(uid=victim.peer.uid, pid=victim.peer.pid, new_uid=conn.peer.uid,
                          reason="no preface" if victim in self.admission.no_preface
                          else "no call in flight" if victim.idle else "calls in flight", key=key)
            self.forget(victim)
            cast(ClientConnection, victim).evict()  # admission holds only the connections admitted here
        self.connections.add(cast(ClientConnection, conn))
        self.admission.add(conn)
        return True

    def preface_received(self, conn: Conn) -> None:
        self.admission.preface_received(conn)

    def forget(self, conn: Conn) -> None:
        self.connections.discard(cast(ClientConnection, conn))
        self.admission.remove(conn)

    def status(self) -> dict[str, Any]:
        """For `cri-shim status`: what clients hold now, against each bound."""
        calls, buf = self.limits.calls, self.limits.request_buffer
        return {"connections": len(self.connections), "max_connections": self.config.max_connections,
                "untrusted_connections_by_uid": self.admission.uids(),
                "intercepted_calls": calls.used, "max_intercepted_calls": calls.limit,
                "request_buffer_bytes": buf.used, "max_request_buffer_bytes": buf.limit}

    def out_of_fds(self, err: OSError, where: str) -> None:
        self._no_fds(error=str(err), where=where, open_connections=len(self.connections),
                     hint="raise LimitNOFILE in the unit or lower server.max_connections")

    async def serve(self, method: str, handler: Handler, request: bytes, metadata: Metadata, deadline: Deadline,
                    send: Send, sent_as: str = "", *, peer: Peer) -> None:
        call = Call(method, metadata, deadline, self.upstream, sent_as=sent_as, peer=peer)
        with self._observe(call):
            if cardinality(method) is Cardinality.SERVER_STREAM:  # the handler is a StreamHandler
                async for msg in cast(AsyncIterator[bytes], handler(request, call)):
                    await send(msg)
            else:
                await send(await cast(Awaitable[bytes], handler(request, call)))

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

    def watch_for_upstream(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._wait_for_upstream(), name="runtime-probe")

    async def _wait_for_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.25)
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_unix_connection(asyncio.Protocol, self.upstream_path), 1.0)
            except (TimeoutError, OSError) as e:
                if isinstance(e, OSError) and e.errno in FD_ERRNOS:
                    self.out_of_fds(e, "probing the runtime")
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
