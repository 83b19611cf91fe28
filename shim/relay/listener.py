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
import dataclasses
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, ContextManager, Mapping

from ..config import DEFAULT_MAX_REQUEST_BYTES
from ..cri.call import Call, Deadline, Handler
from ..cri.methods import Cardinality, cardinality
from ..cri.routing import Router
from ..cri.upstream import Upstream
from ..errors import Metadata
from ..observability import logs
from .admission import Admission
from .connection import FD_ERRNOS, ClientConnection
from .core import Limits
from .memory import Pool

_log = logs.get("relay")

Send = Callable[[bytes], Awaitable[None]]
FDS_PER_CONNECTION = 2
FDS_RESERVED = 64  # runtime channel, metrics, admin socket, logs, image-set watchers
LOG_EVERY_SECONDS = 10.0


@dataclass(frozen=True)
class RelaySettings:
    """server.* keys the relay uses (see shim/config.py and the README's Limits table)."""

    max_connections: int = 256
    listen_backlog: int = 1024
    write_buffer_high: int = 64 << 10
    write_buffer_low: int = 16 << 10
    write_stall_seconds: float = 30.0
    preface_timeout: float = 10.0
    max_header_list_bytes: int = 64 << 10
    max_intercepted_streams: int = 100
    max_concurrent_streams: int = 100
    path_cache_bytes: int = 16 << 10
    max_request_buffer_bytes: int = 64 << 20
    max_intercepted_calls: int = 1024
    max_request_bytes: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(DEFAULT_MAX_REQUEST_BYTES))
    stream_stall_seconds: float = 30.0
    trusted_uids: frozenset[int] = frozenset({0})
    max_connections_per_uid: int = 64


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
    """Accepts CRI clients on a unix socket; one runtime connection per client connection."""

    def __init__(self, upstream_path: str, upstream: Upstream, router: Router[Handler],
                 max_message_bytes: int, observe: Callable[[Call], ContextManager[Call]] | None = None,
                 settings: RelaySettings | None = None) -> None:
        self.upstream_path = upstream_path
        self.upstream = upstream  # grpc channel for the handlers' own calls
        self.router = router
        self._observe = observe or contextlib.nullcontext  # span and rpc duration (cri.call.Observation)
        self.max_message_bytes = max_message_bytes
        self.settings = s = settings or RelaySettings()
        self.limits = Limits(max_message_bytes=max_message_bytes, max_header_list_bytes=s.max_header_list_bytes,
                             max_concurrent_streams=s.max_concurrent_streams,
                             max_intercepted_streams=s.max_intercepted_streams, path_cache_bytes=s.path_cache_bytes,
                             request_buffer=Pool(s.max_request_buffer_bytes), calls=Pool(s.max_intercepted_calls),
                             max_request_bytes=dict(s.max_request_bytes))
        self.connections: set[ClientConnection] = set()
        self.admission = Admission(s.max_connections, s.max_connections_per_uid)
        self._server: asyncio.AbstractServer | None = None
        self._probe: asyncio.Task[None] | None = None
        self._reachable: bool | None = None
        self._refused = _RateLimited("connection refused: server.max_connections reached")
        self._evicted = _RateLimited("closed a connection to make room: server.max_connections reached")
        self.stream_stalled = _RateLimited("ended an intercepted call: the client opens no flow-control window")
        self._no_fds = _RateLimited("out of file descriptors")
        # a client breaking the protocol, logged at most every LOG_EVERY_SECONDS (with a count)
        self.protocol_error = _RateLimited("closing connection: HTTP/2 protocol error")
        self.stream_refused = _RateLimited("stream refused (REFUSED_STREAM, the client retries it): "
                                           "server.max_concurrent_streams reached on its connection")

    @property
    def table(self) -> Mapping[str, Handler]:
        return self.router.table

    async def start(self, path: str) -> None:
        self._raise_fd_limit()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: ClientConnection(self), path,
                                                     backlog=self.settings.listen_backlog)

    def _raise_fd_limit(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
        need = self.settings.max_connections * FDS_PER_CONNECTION + FDS_RESERVED
        if soft != resource.RLIM_INFINITY and soft < need:
            logs.log(_log, logging.WARNING, "file descriptor limit below what server.max_connections needs",
                     limit=soft, needed=need, max_connections=self.settings.max_connections,
                     hint="raise LimitNOFILE in the unit or lower server.max_connections")

    def admit(self, conn: ClientConnection) -> bool:
        """Count a new client connection in, making room first if needed (admission.py)."""
        ok, victim, key = self.admission.room_for(conn)
        if not ok:
            self._refused(uid=conn.peer.uid, pid=conn.peer.pid, max_connections=self.settings.max_connections,
                          key=key)
            return False
        if victim is not None:
            self._evicted(uid=victim.peer.uid, pid=victim.peer.pid, new_uid=conn.peer.uid,
                          reason="no preface" if victim in self.admission.no_preface
                          else "no call in flight" if victim.idle else "calls in flight", key=key)
            self.forget(victim)
            victim.evict()
        self.connections.add(conn)
        self.admission.add(conn)
        return True

    def preface_received(self, conn: ClientConnection) -> None:
        self.admission.preface_received(conn)

    def forget(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)
        self.admission.remove(conn)

    def status(self) -> dict[str, Any]:
        """For `cri-shim status`: what clients hold now, against each bound."""
        calls, buf = self.limits.calls, self.limits.request_buffer
        return {"connections": len(self.connections), "max_connections": self.settings.max_connections,
                "untrusted_connections_by_uid": self.admission.uids(),
                "intercepted_calls": calls.used, "max_intercepted_calls": calls.limit,
                "request_buffer_bytes": buf.used, "max_request_buffer_bytes": buf.limit}

    def out_of_fds(self, err: OSError, where: str) -> None:
        self._no_fds(error=str(err), where=where, open_connections=len(self.connections),
                     hint="raise LimitNOFILE in the unit or lower server.max_connections")

    async def serve(self, method: str, handler: Any, request: bytes, metadata: Metadata, deadline: Deadline,
                    send: Send, sent_as: str = "") -> None:
        call = Call(method, metadata, deadline, self.upstream, sent_as=sent_as)
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
            except (OSError, asyncio.TimeoutError) as e:
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
