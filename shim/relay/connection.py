"""One client connection, relayed to its own runtime connection: the asyncio side.

The HTTP/2 rules live in core.py (sans-IO); this module moves bytes between the two
transports and the core, runs the handlers of intercepted calls, and keeps what a
client can make the shim hold bounded:

- The runtime connection is opened only after a valid client preface; a client that
  sends none within ``preface_timeout`` is closed.
- Write buffers: above ``write_buffer_high`` bytes waiting for the client, the shim
  stops reading the runtime for it, handlers stop sending, and it stops reading the
  client too: a client that does not read its answers gets no new call relayed, so
  the runtime is not left holding answers nobody drains (the core bounds the calls
  in flight, ``max_concurrent_streams``); below ``write_buffer_low`` all go on. A
  client that reads nothing for ``write_stall_seconds`` while over the mark is closed.
  (Frames held for the client's flow-control window, next, stop only the runtime being
  read: the client's WINDOW_UPDATE, which releases them, must still be read; the stream
  limit bounds its calls meanwhile.)
  The same marks apply toward the runtime (a slow runtime stops the client being read)
  and to the runtime frames the core holds for the client's flow-control window.
- Intercepted calls: a request whose body is not complete, or an answer that waits for
  the client's flow-control window, for ``stream_stall_seconds`` is ended; what a
  request holds in the process-wide pools (memory.py) is given back when its handler
  task is done, however it ends. A patched answer (patched.py) that waits for the
  client's windows that long is ended too (RST_STREAM CANCEL both ways).
- The peer (SO_PEERCRED, admission.py) is read at accept: its uid decides its share of
  the pools and how the listener makes room for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import time
from typing import cast

import grpc

from ..cri.call import Handler
from ..cri.deadline import Deadline, enforced
from ..cri.peer import Peer
from ..errors import RpcError
from ..observability import logs
from . import events, grpcwire, http2
from .admission import peer_of
from .core import Phase, RelayCore
from .host import FD_ERRNOS, Host, Send
from .streams import LocalStream

_log = logs.get("relay")

# After the GOAWAY of a connection error the shim stops writing (shutdown SHUT_WR) and reads, and
# drops, what the client still sends for this long or this many bytes, then closes. Closing at
# once would reset the connection (a unix socket closed with unread bytes gives its peer
# ECONNRESET), and a client whose own frames were in flight might never read the GOAWAY.
# Go's HTTP/2 server lingers the same way (1 s) after its GOAWAY.
CLOSE_LINGER_SECONDS = 1.0
CLOSE_LINGER_BYTES = 64 * 1024


class _RuntimeProtocol(asyncio.Protocol):
    """The relay's raw socket to the runtime, one per client connection (the handlers' own
    calls go over the grpc channel of shim/cri/upstream.py instead)."""

    def __init__(self, conn: ClientConnection) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.from_upstream(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.upstream_lost()

    def pause_writing(self) -> None:  # the runtime is slow to read: stop reading the client
        self.conn.core.runtime_reads_slowly(True)
        self.conn.pause("client", "runtime-slow")

    def resume_writing(self) -> None:
        self.conn.core.runtime_reads_slowly(False)
        self.conn.resume("client", "runtime-slow")


class ClientConnection(asyncio.Protocol):
    def __init__(self, host: Host) -> None:
        self.host = host
        self.config = host.limits.server  # server.* (shim/config.py)
        self.loop = asyncio.get_running_loop()
        self.core: RelayCore  # built at connection_made, once the peer (trusted or not) is known
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.orphaned = False  # the runtime connection is gone; local calls finish
        self._closed = False
        self._paused: dict[str, set[str]] = {"client": set(), "upstream": set()}
        self._client_write_paused = False
        self._waiters: list[asyncio.Future[None]] = []
        self._stall: asyncio.TimerHandle | None = None
        self._preface_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._patch_timer: asyncio.TimerHandle | None = None  # a patched answer waiting for the client's windows
        self.peer = Peer()
        self._connecting: asyncio.Task[None] | None = None  # held: the loop keeps only weak references
        self._linger_bytes = -1  # >= 0 while lingering after the GOAWAY of a closed connection

    # ------------------------------------------------------------------ lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = cast(asyncio.Transport, transport)  # a stream server's transport
        s = self.config
        self.peer = peer_of(transport, s.trusted_uids)
        self.core = RelayCore(self.host.limits, self.host.route, trusted=self.peer.trusted)
        if not self.host.admit(self):
            self._closed = True
            transport.close()
            return
        self.client.set_write_buffer_limits(s.write_buffer_high_bytes, s.write_buffer_low_bytes)
        self._preface_timer = self.loop.call_later(s.preface_timeout_seconds, self._no_preface)

    def _no_preface(self) -> None:
        if self.core.phase is Phase.PREFACE and self.client is not None:
            self.client.close()

    def data_received(self, data: bytes) -> None:
        if self._linger_bytes >= 0:
            self._drop_after_goaway(len(data))
            return
        self.core.receive_client(data)
        self._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.host.forget(self)
        for t in (self._stall, self._preface_timer, self._body_timer, self._patch_timer):
            if t is not None:
                t.cancel()
        if self.upstream is not None:
            self.upstream.close()
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        self.core.calls.release_all()
        self.core.patching.lost()  # the patched answers it held: free in the process pools
        self.core.decoder.clear_cache()
        self._wake()

    async def _connect(self) -> None:
        try:
            transport, _ = await asyncio.wait_for(
                self.loop.create_unix_connection(lambda: _RuntimeProtocol(self), self.host.upstream_path), 2.0)
        except (TimeoutError, OSError) as e:
            if self._closed:
                return
            if isinstance(e, OSError) and e.errno in FD_ERRNOS:
                self.host.out_of_fds(e, "connecting to the runtime")
                self.core.start_local(f"cri-shim: out of file descriptors ({errno.errorcode[e.errno]}); "
                                      "retry, or raise LimitNOFILE / lower server.max_connections")
                self.loop.call_later(1.0, self.send_away, b"cri-shim: out of file descriptors")
            else:
                self.host.upstream_unreachable(e)
                self.core.start_local(f"cri-shim: the container runtime at {self.host.upstream_path} "
                                      "is not reachable")
                self.host.watch_for_upstream()
            self.resume("client", "connecting")
            self._pump()
            return
        if self._closed:
            transport.close()
            return
        self.upstream = transport
        transport.set_write_buffer_limits(self.config.write_buffer_high_bytes, self.config.write_buffer_low_bytes)
        self.host.upstream_reachable()
        self.core.start_relay()
        self.resume("client", "connecting")
        self._pump()

    def upstream_lost(self) -> None:
        """The runtime closed the connection (see RelayCore.runtime_lost)."""
        if self._closed or self.core.phase is Phase.CLOSED:
            return
        self.host.upstream_unreachable(None)
        self.upstream = None
        if self.core.streams.relayed:
            logs.log(_log, logging.WARNING, "runtime connection lost with calls in flight",
                     calls=len(self.core.streams.relayed))
        self.orphaned = True
        self.core.runtime_lost()
        self._pump()

    def send_away(self, debug: bytes) -> None:
        """GOAWAY now and close shortly: the client reconnects (runtime back, fds freed)."""
        if self._closed or self.client is None or self.core.phase is not Phase.LOCAL or self.orphaned:
            return
        self.core.begin_shutdown(debug)
        self._pump()
        self.loop.call_later(0.2, self.client.close)

    def runtime_back(self) -> None:
        self.send_away(b"cri-shim: runtime reachable again")

    def begin_shutdown(self) -> None:
        """Tell the client to open no new streams here; in-flight ones go on."""
        if self._closed or self.client is None:
            return
        if self.core.phase is Phase.PREFACE or self.core.phase is Phase.WAITING:
            self.client.close()
            return
        self.core.begin_shutdown()
        self._pump()

    @property
    def busy(self) -> bool:
        return self.core.busy

    @property
    def idle(self) -> bool:
        """Past the preface, with no call in flight: it can be sent away."""
        return (self.core.phase is Phase.RELAY or self.core.phase is Phase.LOCAL) and not self.core.busy \
            and not self.tasks

    def evict(self) -> None:
        """Make room under server.max_connections: GOAWAY (if past the preface), close."""
        if self.client is None or self._closed:
            return
        if self.core.phase is Phase.RELAY or self.core.phase is Phase.LOCAL:
            self.core.begin_shutdown(b"cri-shim: server.max_connections reached; reconnect")
            self._pump()
        self.client.close()

    def abort(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.upstream is not None:
            self.upstream.close()

    def _linger(self) -> None:
        """The GOAWAY is written: stop writing, drop what the client still sends, close soon."""
        client = self.client
        if client is None or client.is_closing():
            return
        if not client.can_write_eof():
            client.close()
            return
        client.write_eof()  # after the buffered frames, the GOAWAY last
        self._linger_bytes = 0
        self._paused["client"].clear()
        client.resume_reading()
        self.loop.call_later(CLOSE_LINGER_SECONDS, client.abort)  # abort: whatever it has not read goes too

    def _drop_after_goaway(self, n: int) -> None:
        self._linger_bytes += n
        if self._linger_bytes > CLOSE_LINGER_BYTES and self.client is not None:
            self.client.abort()

    # ------------------------------------------------------------------ moving bytes

    def from_upstream(self, data: bytes) -> None:
        self.core.receive_runtime(data)
        self._pump()

    def _pump(self) -> None:
        """Write what the core produced and act on its events."""
        core = self.core
        output = core.output
        if output.frames:
            out = output.take()
            if self.client is not None and not self.client.is_closing() and self._linger_bytes < 0:
                # Never write to a closing transport (the peer may be gone before connection_lost
                # has run, and uvloop raises there), nor after the GOAWAY's write_eof.
                self.client.write(out)
        if core.to_runtime:
            up = core.take_runtime()
            if self.upstream is not None and not self.upstream.is_closing():
                self.upstream.write(up)
        if core.events:
            self._handle(core.take_events())
        paused = self._paused
        if core.window.held_bytes or output.deferred_bytes or paused["upstream"] or paused["client"]:
            self._held_backpressure()
        local = core.streams.local
        if core.window.held and self._patch_timer is None and (core.patching.streams or core.carrying):
            self._expire_patched()
        if local and self._body_timer is None and core.calls.incomplete:
            self._body_timer = self.loop.call_later(self.config.stream_stall_seconds, self._expire_bodies)
        if self.orphaned and not local and not self.tasks and self.client is not None:
            self.client.close()

    def _handle(self, evs: list[events.Event]) -> None:
        for ev in evs:
            if isinstance(ev, events.Request):
                self._dispatch(ev.stream)
            elif isinstance(ev, events.WindowOpened):
                self._wake()
            elif isinstance(ev, events.Cancelled):
                task = self.tasks.pop(ev.sid, None)
                if task is not None and task is not asyncio.current_task():
                    task.cancel()
            elif isinstance(ev, events.StreamRefused):
                self.host.stream_refused(limit=ev.limit)
            elif isinstance(ev, events.PrefaceReceived):
                if self._preface_timer is not None:
                    self._preface_timer.cancel()
                self.host.preface_received(self)
                self.pause("client", "connecting")
                self._connecting = self.loop.create_task(self._connect(), name="relay-connect")
            elif isinstance(ev, events.ConnectionClosed):
                if ev.reason:
                    self.host.protocol_error(error=ev.reason, code=ev.code)
                if self.upstream is not None:
                    self.upstream.close()
                self._linger()

    def _expire_patched(self) -> None:
        """A patched answer (relay/patched.py) the client's windows held for server.stream_stall_seconds ends."""
        self._patch_timer = None
        if self._closed:
            return
        stall = self.config.stream_stall_seconds
        if self.core.carrying:  # a runtime header block waits for an intercepted answer (carried.py)
            method, when = self.core.expire_carried(stall)
            if method:
                self.host.answer_overdue(method=method, seconds=stall, key="server.stream_stall_seconds")
        else:
            method, when = self.core.expire_patched(stall)
            if method:
                self.host.stream_stalled(method=method, seconds=stall, key="server.stream_stall_seconds")
        if when is not None:
            self._patch_timer = self.loop.call_later(max(0.0, when - time.monotonic()), self._expire_patched)
        if method:
            self._pump()

    def _expire_bodies(self) -> None:
        """Intercepted requests whose body did not arrive within server.stream_stall_seconds end."""
        self._body_timer = None
        if self._closed:
            return
        stall = self.config.stream_stall_seconds
        now = time.monotonic()  # the core's clock
        oldest = self.core.calls.expire_incomplete(now - stall, stall)
        if oldest is not None:
            self._body_timer = self.loop.call_later(max(0.0, oldest + stall - now), self._expire_bodies)
        self._pump()

    def _held_backpressure(self) -> None:
        """Runtime frames held for the client's window, and the shim's own frames held
        while a runtime header block is open, count like a write buffer."""
        held, deferred, s = self.core.window.held_bytes, self.core.output.deferred_bytes, self.config
        if held > s.write_buffer_high_bytes:
            self.pause("upstream", "held")
        elif held <= s.write_buffer_low_bytes and "held" in self._paused["upstream"]:
            self.resume("upstream", "held")
        if deferred > s.write_buffer_high_bytes:
            self.pause("client", "deferred")
        elif deferred <= s.write_buffer_low_bytes and "deferred" in self._paused["client"]:
            self.resume("client", "deferred")

    # ------------------------------------------------------------------ back-pressure

    def paused(self, which: str) -> frozenset[str]:
        """Why the shim does not read ``which`` (client, upstream) now; empty while it reads it."""
        return frozenset(self._paused[which])

    def pause(self, which: str, reason: str) -> None:
        reasons = self._paused[which]
        transport = self.client if which == "client" else self.upstream
        if not reasons and transport is not None and not transport.is_closing():
            transport.pause_reading()
        reasons.add(reason)

    def resume(self, which: str, reason: str) -> None:
        reasons = self._paused[which]
        if reason not in reasons:
            return
        reasons.discard(reason)
        transport = self.client if which == "client" else self.upstream
        if not reasons and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def pause_writing(self) -> None:  # the client is slow to read: hold its answers, relay no new calls
        self._client_write_paused = True
        self.pause("upstream", "client-slow")
        self.pause("client", "client-slow")
        if self._stall is None:
            self._stall = self.loop.call_later(self.config.write_stall_seconds, self._stalled)

    def resume_writing(self) -> None:
        self._client_write_paused = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.resume("client", "client-slow")
        self.resume("upstream", "client-slow")
        self._wake()

    def _stalled(self) -> None:
        self._stall = None
        if self.client is None or self._closed:
            return
        logs.log(_log, logging.WARNING, "closing connection: the client reads nothing",
                 seconds=self.config.write_stall_seconds,
                 buffered_bytes=self.client.get_write_buffer_size(), key="server.write_stall_seconds")
        self.client.abort()
        if self.upstream is not None:
            self.upstream.close()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def _writable(self) -> asyncio.Future[None]:
        """Done at the next wake-up (_wake). Registered at once, not when an awaiting task
        first runs: a WINDOW_UPDATE read in between must not be lost."""
        fut = self.loop.create_future()
        self._waiters.append(fut)
        return fut

    # ------------------------------------------------------------------ locally answered streams

    def _dispatch(self, s: LocalStream) -> None:
        """Run the handler the call was routed to at its HEADERS (the table is not looked up again)."""
        task = self.loop.create_task(self._serve_local(s, s.handler), name=f"cri {s.path}")
        # done, however it ends (also cancelled before it ran): the request's share is free
        task.add_done_callback(functools.partial(self._handler_ended, s))
        self.tasks[s.sid] = task

    def _handler_ended(self, s: LocalStream, _: asyncio.Task[None]) -> None:
        self.core.calls.handler_ended(s)

    async def _serve_local(self, s: LocalStream, handler: Handler) -> None:
        calls = self.core.calls
        hdr = dict(s.headers)
        try:  # everything read from the client is parsed inside: the stream is answered whatever it holds
            timeout = grpcwire.parse_timeout(hdr[b"grpc-timeout"]) if b"grpc-timeout" in hdr else None
            # counted from the call's HEADERS (s.opened, the core's clock), as grpc.aio counts it
            deadline = Deadline.after(None if timeout is None else timeout - (time.monotonic() - s.opened))
            metadata = grpcwire.metadata(s.headers)
            sent_as = hdr[b":path"].decode("latin-1")
            body, s.body = bytes(s.body), bytearray()
            messages = grpcwire.unframe_messages(body, hdr.get(b"grpc-encoding"), s.limit)
            inflated = sum(map(len, messages)) - len(body)  # decompressed: the handler holds more than arrived
            del body
            if inflated > 0 and not calls.charge(s, inflated):
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "cri-shim: decompressed requests would pass server.max_request_buffer_bytes; retry")
            if len(messages) != 1:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"cri-shim: {s.path} expects one request message, got {len(messages)}")
            coro = self.host.serve(s.path, handler, messages[0], metadata, deadline, self._sender(s),
                                   sent_as="" if sent_as == s.path else sent_as, peer=self.peer)
            del messages
            async with enforced(deadline, lambda: "cri-shim: deadline exceeded"):  # grpc-timeout, if any
                await coro
            calls.send_trailers(s, grpcwire.trailers(grpc.StatusCode.OK))
        except RpcError as e:
            calls.answer_error(s, e.code, e.details, e.trailing_metadata)
        except grpcwire.MessageTooLarge as e:
            calls.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED, f"cri-shim: {e} ({s.limit_key})")
        except grpcwire.HeaderError as e:  # as grpc-go answers it
            calls.answer_error(s, grpc.StatusCode.INTERNAL, str(e))
        except grpcwire.MessageError as e:
            calls.answer_error(s, grpc.StatusCode.INVALID_ARGUMENT, f"cri-shim: {e}")
        except asyncio.CancelledError:
            pass  # the client went away (RST_STREAM or connection closed)
        except Exception:  # noqa: BLE001  (a handler's bug: this call answers INTERNAL, logged with its traceback)
            _log.error("handler failed", extra={"fields": {"method": s.path}}, exc_info=True)
            calls.answer_error(s, grpc.StatusCode.INTERNAL, f"cri-shim: internal error in {s.path}")
        finally:
            if self.tasks.get(s.sid) is asyncio.current_task():
                del self.tasks[s.sid]
            if not self._closed:
                self._pump()

    def _sender(self, s: LocalStream) -> Send:
        core, calls = self.core, self.core.calls

        async def send(msg: bytes) -> None:
            if core.stream_gone(s):
                raise asyncio.CancelledError()
            calls.send_headers(s)
            view = memoryview(grpcwire.frame_message(msg))
            stalled_since = None
            while view:
                if core.stream_gone(s) or self._closed:
                    raise asyncio.CancelledError()
                room = 0 if self._client_write_paused else calls.send_room(s)
                if room <= 0:
                    stall = self.config.stream_stall_seconds
                    now = self.loop.time()
                    stalled_since = now if stalled_since is None else stalled_since
                    if now - stalled_since >= stall:  # the client opens no window: end the call
                        self.host.stream_stalled(method=s.path, seconds=stall, key="server.stream_stall_seconds")
                        calls.reset(s, http2.CANCEL)
                        self._pump()
                        raise asyncio.CancelledError()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._writable(), stalled_since + stall - now)
                    continue
                stalled_since = None
                calls.send_data(s, bytes(view[:room]))
                view = view[room:]
                self._pump()
        return send
