"""One client connection, relayed frame by frame to its own runtime connection.

Frames pass through unchanged (only SETTINGS gain HEADER_TABLE_SIZE=0, see h2.py),
so for every method we don't intercept the runtime's answer — status, details,
trailers, streams, deadlines, cancellation — reaches the client byte for byte, at
the cost of finding frame boundaries and one ``:path`` per call.

A stream whose ``:path`` is in the interception table is answered here instead:
its frames stop at the relay, a handler task runs with the request message, and the
response is written on the client connection with header blocks that use no HPACK
dynamic table. Connection-level flow control is shared with the runtime's data, so
the relay keeps the client's real window itself: the runtime's DATA waits in order
when the client's window is short, and client WINDOW_UPDATEs that repay the relay's
own DATA are not passed on to the runtime.

A client's PING goes to the runtime only if the runtime has sent HEADERS or DATA
since the last PING it got; otherwise the relay answers it. gRPC servers (grpc-go in
containerd and CRI-O, grpc-core) count such a PING as a strike and after two strikes
close the connection with GOAWAY "too_many_pings" — and clients PING when response
data arrives, also data the relay wrote for a stream the runtime never saw. A storm of
locally answered pulls would otherwise get kubelet's connection closed under it.

When the runtime can't be reached, the connection is answered locally: every call
gets UNAVAILABLE at once, and GOAWAY sends the client back as soon as the runtime
is reachable again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from .. import logs
from ..errors import RpcError
from . import grpcwire, h2
from .h2 import H2Error

if TYPE_CHECKING:
    from .listener import Relay

_log = logs.get("relay")


@dataclass
class LocalContext:
    """The part of a servicer context an interception handler uses."""

    deadline: float | None
    md: tuple[tuple[str, str | bytes], ...]
    loop: asyncio.AbstractEventLoop

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.loop.time())

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.md


@dataclass(eq=False)
class LocalStream:
    sid: int
    method: str
    headers: list[tuple[bytes, bytes]]
    body: bytearray = field(default_factory=bytearray)
    send_window: int = h2.DEFAULT_WINDOW
    task: asyncio.Task[None] | None = None
    handler: Any = None
    headers_sent: bool = False
    done: bool = False


class _Upstream(asyncio.Protocol):
    def __init__(self, conn: "ClientConnection") -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.from_upstream(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.upstream_lost()

    def pause_writing(self) -> None:
        self.conn.pause_client()

    def resume_writing(self) -> None:
        self.conn.resume_client()


class ClientConnection(asyncio.Protocol):
    def __init__(self, relay: "Relay") -> None:
        self.relay = relay
        self.loop = asyncio.get_running_loop()
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.mode = "connecting"  # connecting | relay | local | closed
        self._pending = bytearray()  # client bytes received while connecting
        self._cbuf = b""
        self._preface_done = False
        self._ubuf = b""
        self.decoder = h2.Decoder()
        self._header_frames: list[bytes] = []  # a header block spread over CONTINUATIONs
        self._header_fragments: list[bytes] = []
        self._header_sid = 0
        self._header_flags = 0
        self.local: dict[int, LocalStream] = {}
        self.dropped_upstream: set[int] = set()  # streams whose runtime frames are discarded
        self.relayed_open: set[int] = set()
        self.responding: set[int] = set()  # relayed streams whose response headers went out
        self._upstream_block_open = False  # the runtime is midway through a header block
        self.last_sid = 0
        # flow control toward the client (connection level)
        self.client_window = h2.DEFAULT_WINDOW
        self.client_initial_stream_window = h2.DEFAULT_WINDOW
        self.client_max_frame = h2.DEFAULT_MAX_FRAME
        self.owed = 0  # bytes of our own DATA the client has not yet refunded
        self._unacked_client_settings: deque[bytes] = deque()
        self._held: deque[bytes] = deque()  # runtime frames waiting for the client's window
        self._window_waiters: list[asyncio.Future[None]] = []
        self.going_away = False
        # The runtime sent HEADERS or DATA since the last client PING it got (a first PING
        # is never a strike), so it would take the next one without complaint.
        self.runtime_spoke = True

    # ------------------------------------------------------------------ lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport  # type: ignore[assignment]
        self.relay.connections.add(self)
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            transport, _ = await asyncio.wait_for(
                self.loop.create_unix_connection(lambda: _Upstream(self), self.relay.upstream_path), 2.0)
        except (OSError, asyncio.TimeoutError) as e:
            if self.mode == "closed":
                return
            self.relay.upstream_unreachable(e)
            self.mode = "local"
            self._start_local()
            return
        if self.mode == "closed":
            transport.close()
            return
        self.upstream = transport  # type: ignore[assignment]
        self.mode = "relay"
        self.relay.upstream_reachable()
        if self._pending:
            data, self._pending = bytes(self._pending), bytearray()
            self.from_client(data)

    def data_received(self, data: bytes) -> None:
        if self.mode == "relay" or self.mode == "orphaned":
            self.from_client(data)
        elif self.mode == "local":
            self.from_client_local(data)
        elif self.mode == "connecting":
            self._pending += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.mode = "closed"
        self.relay.connections.discard(self)
        if self.upstream is not None:
            self.upstream.close()
        for s in self.local.values():
            if s.task is not None:
                s.task.cancel()
        self._wake_window_waiters()

    def upstream_lost(self) -> None:
        """The runtime closed the connection.

        Relayed calls on it get UNAVAILABLE and the client gets GOAWAY, so it reconnects
        for new calls. Calls the shim answers itself (a pull other callers may have
        joined) finish first, unless the runtime left a header block half sent, in
        which case nothing more can be written on the connection and it closes at once.
        """
        if self.mode == "closed":
            return
        self.relay.upstream_unreachable(None)
        self.upstream = None
        if self.relayed_open:
            logs.log(_log, logging.WARNING, "runtime connection lost with calls in flight",
                     calls=len(self.relayed_open))
        if not self.local or self._held or self._upstream_block_open:
            self._close_client()
            return
        self.mode = "orphaned"
        out = [h2.goaway(self.last_sid, h2.NO_ERROR, b"cri-shim: runtime connection closed")]
        for sid in sorted(self.relayed_open):
            block = h2.encode_headers(grpcwire.trailers(
                grpc.StatusCode.UNAVAILABLE, "cri-shim: the runtime closed the connection",
                trailers_only=sid not in self.responding))
            out.append(h2.headers_frames(sid, block, True, self.client_max_frame))
        self.relayed_open.clear()
        self._write(b"".join(out))

    def _close_client(self) -> None:
        if self.client is not None and not self.client.is_closing():
            self.client.write(h2.goaway(self.last_sid, h2.NO_ERROR, b"cri-shim: runtime connection closed"))
            self.client.close()
        self.mode = "closed"

    def pause_client(self) -> None:
        if self.client is not None:
            self.client.pause_reading()

    def resume_client(self) -> None:
        if self.client is not None:
            self.client.resume_reading()

    def pause_writing(self) -> None:  # the client is slow to read: stop reading the runtime
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def begin_shutdown(self) -> None:
        """Tell the client to open no new streams here; in-flight ones go on."""
        if self.going_away or self.client is None or self.client.is_closing():
            return
        self.going_away = True
        self.client.write(h2.goaway(self.last_sid, h2.NO_ERROR, b"cri-shim shutting down"))

    @property
    def busy(self) -> bool:
        return bool(self.relayed_open or self.local)

    def abort(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.upstream is not None:
            self.upstream.close()

    def _protocol_error(self, e: H2Error) -> None:
        logs.log(_log, logging.WARNING, "closing connection: HTTP/2 protocol error", error=str(e))
        if self.client is not None and not self.client.is_closing():
            self.client.write(h2.goaway(self.last_sid, e.code, str(e).encode()[:200]))
            self.client.close()
        if self.upstream is not None:
            self.upstream.close()
        self.mode = "closed"

    # ------------------------------------------------------------------ client -> runtime

    def from_client(self, data: bytes) -> None:
        buf = self._cbuf + data if self._cbuf else data
        out: list[bytes] = []
        i, n = 0, len(buf)
        if not self._preface_done:
            if not self._take_preface(buf):
                return
            out.append(h2.PREFACE)
            i = 24
        try:
            while n - i >= 9:
                length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
                end = i + 9 + length
                if end > n:
                    break
                ftype, flags = buf[i + 3], buf[i + 4]
                sid = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
                raw = buf[i:end]
                i = end
                if ftype == h2.DATA:
                    s = self.local.get(sid)
                    if s is None:
                        out.append(raw)
                        if self.upstream is None and length:  # orphaned: nobody else refunds it
                            self._write(h2.window_update(0, length))
                    else:
                        self._local_data(s, flags, raw[9:])
                elif ftype == h2.HEADERS or ftype == h2.CONTINUATION:
                    self._client_headers(ftype, flags, sid, raw, out)
                elif ftype == h2.WINDOW_UPDATE:
                    inc = int.from_bytes(raw[9:13], "big") & 0x7FFFFFFF
                    if sid == 0:
                        self.client_window += inc
                        repay = min(inc, self.owed)
                        self.owed -= repay
                        if inc > repay:
                            out.append(h2.window_update(0, inc - repay) if repay else raw)
                        self._flush_held()
                        self._wake_window_waiters()
                    elif sid in self.local:
                        self.local[sid].send_window += inc
                        self._wake_window_waiters()
                    elif sid not in self.dropped_upstream:
                        out.append(raw)
                elif ftype == h2.SETTINGS:
                    if flags & h2.ACK:
                        out.append(raw)
                    else:  # in force for us once the runtime's ACK reaches the client
                        self._unacked_client_settings.append(raw[9:])
                        out.append(h2.frame(h2.SETTINGS, flags, 0, h2.with_table_size_zero(raw[9:])))
                elif ftype == h2.RST_STREAM:
                    s = self.local.get(sid)
                    if s is not None:
                        if s.task is not None:
                            s.task.cancel()
                        self.local.pop(sid, None)
                    elif sid not in self.dropped_upstream:
                        self.relayed_open.discard(sid)
                        self.responding.discard(sid)
                        out.append(raw)
                elif ftype == h2.PRIORITY:
                    if sid not in self.local and sid not in self.dropped_upstream:
                        out.append(raw)
                elif ftype == h2.PING and length != 8:
                    raise H2Error(f"PING frame of {length} bytes", h2.FRAME_SIZE_ERROR)
                elif ftype == h2.PING and not flags & h2.ACK and not self.runtime_spoke:
                    self._write(h2.frame(h2.PING, h2.ACK, 0, raw[9:]))  # see the module docstring
                else:  # PING, PING ACK, GOAWAY, unknown extension frames
                    if ftype == h2.PING and not flags & h2.ACK:
                        self.runtime_spoke = False
                    out.append(raw)
        except H2Error as e:
            self._protocol_error(e)
            return
        except Exception as e:  # malformed input we did not foresee: drop this connection only
            self._protocol_error(H2Error(f"malformed frame: {e!r}"))
            return
        self._cbuf = buf[i:]
        if out and self.upstream is not None and not self.upstream.is_closing():
            self.upstream.write(b"".join(out) if len(out) > 1 else out[0])

    def _take_preface(self, buf: bytes) -> bool:
        """True once ``buf`` starts with the client preface; keeps a short buffer; closes on garbage."""
        if len(buf) < 24:
            self._cbuf = buf
            return False
        if buf[:24] != h2.PREFACE:
            self._protocol_error(H2Error("not an HTTP/2 client preface"))
            return False
        self._preface_done = True
        return True

    def _client_settings(self, payload: bytes) -> None:
        values = h2.settings_payload(payload)
        if h2.SETTINGS_INITIAL_WINDOW_SIZE in values:
            new = values[h2.SETTINGS_INITIAL_WINDOW_SIZE]
            delta = new - self.client_initial_stream_window
            self.client_initial_stream_window = new
            for s in self.local.values():
                s.send_window += delta
            self._wake_window_waiters()
        if h2.SETTINGS_MAX_FRAME_SIZE in values:
            self.client_max_frame = values[h2.SETTINGS_MAX_FRAME_SIZE]

    def _client_headers(self, ftype: int, flags: int, sid: int, raw: bytes, out: list[bytes]) -> None:
        if ftype == h2.HEADERS:
            if self._header_frames:
                raise H2Error("HEADERS while a header block is open")
            self._header_sid, self._header_flags = sid, flags
            fragment = h2.header_block_fragment(ftype, flags, raw[9:])
        else:
            if not self._header_frames or sid != self._header_sid:
                raise H2Error("unexpected CONTINUATION")
            fragment = raw[9:]
        self._header_frames.append(raw)
        self._header_fragments.append(fragment)
        if not flags & h2.END_HEADERS:
            return
        frames, fragments = self._header_frames, self._header_fragments
        self._header_frames, self._header_fragments = [], []
        block = fragments[0] if len(fragments) == 1 else b"".join(fragments)
        new_stream = sid > self.last_sid
        if new_stream:
            self.last_sid = sid
        if not new_stream or self.going_away:
            path, _, _ = self.decoder.decode(block)
            if sid in self.local:
                return  # trailers from a client on a stream we answer: nothing to do
            out.extend(frames)
            return
        snapshot = self.decoder.snapshot()
        path, _, inserted = self.decoder.decode(block)
        handler = self.relay.table.get(path.decode("latin-1")) if path is not None else None
        if handler is None:
            if self.upstream is None:  # orphaned: the runtime connection is gone
                self._write(h2.headers_frames(sid, h2.encode_headers(grpcwire.trailers(
                    grpc.StatusCode.UNAVAILABLE, "cri-shim: the runtime closed the connection",
                    trailers_only=True)), True, self.client_max_frame))
                return
            self.relayed_open.add(sid)
            if _log.isEnabledFor(logging.DEBUG):  # log.level: debug names every relayed call
                logs.log(_log, logging.DEBUG, "relayed", method=path.decode("latin-1") if path else "")
            out.extend(frames)
            return
        self.decoder.restore(snapshot)  # decode again, this time every header
        _, headers, _ = self.decoder.decode(block, full=True)
        if inserted:
            # The block changed the runtime's HPACK table: it must still see it. Then cancel.
            out.extend(frames)
            out.append(h2.rst_stream(sid, h2.CANCEL))
            self.dropped_upstream.add(sid)
        self._open_local(sid, path.decode("latin-1"), headers, handler, self._header_flags)

    # ------------------------------------------------------------------ runtime -> client

    def from_upstream(self, data: bytes) -> None:
        if self.mode == "closed":  # the client left (a connect-and-close probe); the runtime's bytes have nowhere to go
            return
        buf = self._ubuf + data if self._ubuf else data
        out: list[bytes] = []
        i, n = 0, len(buf)
        while n - i >= 9:
            length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
            end = i + 9 + length
            if end > n:
                break
            ftype, flags = buf[i + 3], buf[i + 4]
            sid = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
            raw = buf[i:end]
            i = end
            if ftype == h2.HEADERS or ftype == h2.DATA:
                self.runtime_spoke = True
            if ftype == h2.HEADERS or ftype == h2.CONTINUATION:
                self._upstream_block_open = not flags & h2.END_HEADERS
                if ftype == h2.HEADERS and sid in self.relayed_open:
                    self.responding.add(sid)
            if sid and sid in self.dropped_upstream:
                if ftype == h2.RST_STREAM or (flags & h2.END_STREAM and ftype in (h2.HEADERS, h2.DATA)):
                    self.dropped_upstream.discard(sid)
                continue
            if sid and sid in self.local:
                # A stream we answer ourselves whose header block the runtime had to see: grpc-go
                # may answer it (an unknown method: trailers at once) and then RST_STREAM(NO_ERROR)
                # before it reads our RST_STREAM. None of that is the client's.
                continue
            if ftype == h2.SETTINGS:
                if not flags & h2.ACK:
                    raw = h2.frame(h2.SETTINGS, flags, 0, h2.with_table_size_zero(raw[9:]))
                elif self._unacked_client_settings:
                    self._client_settings(self._unacked_client_settings.popleft())
            elif sid and (ftype == h2.RST_STREAM or (flags & h2.END_STREAM and ftype in (h2.HEADERS, h2.DATA))):
                self.relayed_open.discard(sid)
                self.responding.discard(sid)
            if ftype == h2.DATA and length:
                if self._held or self.client_window < length:
                    self._held.append(raw)
                    continue
                self.client_window -= length
            elif self._held:
                self._held.append(raw)
                continue
            out.append(raw)
        self._ubuf = buf[i:]
        if out and self.client is not None and not self.client.is_closing():
            self.client.write(b"".join(out) if len(out) > 1 else out[0])

    def _flush_held(self) -> None:
        out = []
        while self._held:
            raw = self._held[0]
            if raw[3] == h2.DATA:
                length = len(raw) - 9
                if length > self.client_window:
                    break
                self.client_window -= length
            out.append(self._held.popleft())
        if out and self.client is not None and not self.client.is_closing():
            self.client.write(b"".join(out))

    # ------------------------------------------------------------------ locally answered streams

    def _open_local(self, sid: int, method: str, headers: list[tuple[bytes, bytes]], handler: Any,
                    flags: int) -> None:
        s = LocalStream(sid, method, headers, send_window=self.client_initial_stream_window)
        self.local[sid] = s
        if flags & h2.END_STREAM:
            self._dispatch(s, handler)
        else:
            s.handler = handler

    def _local_data(self, s: LocalStream, flags: int, payload: bytes) -> None:
        body = h2.data_payload(flags, payload)
        s.body += body
        if len(s.body) > self.relay.max_message_bytes + 5:
            self._answer_error(s, RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"cri-shim: request larger than server.max_message_bytes "
                                           f"({self.relay.max_message_bytes} bytes)"))
            return
        if payload:  # give the client its windows back at once
            self._write(h2.window_update(0, len(payload)) + h2.window_update(s.sid, len(payload)))
        if flags & h2.END_STREAM and s.task is None:
            self._dispatch(s, s.handler)

    def _dispatch(self, s: LocalStream, handler: Any) -> None:
        s.task = self.loop.create_task(self._serve_local(s, handler), name=f"cri {s.method}")

    async def _serve_local(self, s: LocalStream, handler: Any) -> None:
        hdr = dict(s.headers)
        timeout = grpcwire.parse_timeout(hdr[b"grpc-timeout"]) if b"grpc-timeout" in hdr else None
        deadline = None if timeout is None else self.loop.time() + timeout
        ctx = LocalContext(deadline, grpcwire.metadata(s.headers), self.loop)
        try:
            messages = grpcwire.unframe_messages(bytes(s.body), hdr.get(b"grpc-encoding"))
            if len(messages) != 1:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"cri-shim: {s.method} expects one request message, got {len(messages)}")
            coro = self.relay.serve(s.method, handler, messages[0], ctx, self._send_message_factory(s))
            if timeout is None:
                await coro
            else:
                await asyncio.wait_for(coro, timeout)
            await self._send_trailers(s, grpcwire.trailers(grpc.StatusCode.OK))
        except RpcError as e:
            self._answer_error(s, e)
        except grpcwire.MessageError as e:
            self._answer_error(s, RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"cri-shim: {e}"))
        except asyncio.TimeoutError:
            self._answer_error(s, RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "cri-shim: deadline exceeded"))
        except asyncio.CancelledError:
            pass  # the client went away (RST_STREAM or connection closed)
        except Exception:
            _log.error("handler failed", extra={"fields": {"method": s.method}}, exc_info=True)
            self._answer_error(s, RpcError(grpc.StatusCode.INTERNAL, f"cri-shim: internal error in {s.method}"))
        finally:
            self.local.pop(s.sid, None)
            if self.mode == "orphaned" and not self.local:
                self._close_client()

    def _send_message_factory(self, s: LocalStream) -> Any:
        async def send(msg: bytes) -> None:
            if not s.done and not s.headers_sent:
                s.headers_sent = True
                self._write(h2.headers_frames(s.sid, h2.encode_headers(grpcwire.RESPONSE_HEADERS), False,
                                              self.client_max_frame))
            await self._send_data(s, grpcwire.frame_message(msg))
        return send

    async def _send_data(self, s: LocalStream, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.mode == "closed" or s.sid not in self.local:
                raise asyncio.CancelledError()
            room = min(self.client_window, s.send_window, self.client_max_frame, len(view))
            if room <= 0 or self._held:
                fut = self.loop.create_future()
                self._window_waiters.append(fut)
                await fut
                continue
            chunk = bytes(view[:room])
            view = view[room:]
            self.client_window -= room
            s.send_window -= room
            self.owed += room
            self._write(h2.frame(h2.DATA, 0, s.sid, chunk))

    async def _send_trailers(self, s: LocalStream, headers: list[tuple[bytes, bytes]]) -> None:
        if s.done:
            return
        s.done = True
        if not s.headers_sent:
            headers = list(grpcwire.RESPONSE_HEADERS) + headers
        self._write(h2.headers_frames(s.sid, h2.encode_headers(headers), True, self.client_max_frame))

    def _answer_error(self, s: LocalStream, e: RpcError) -> None:
        if s.done:
            return
        s.done = True
        block = h2.encode_headers(grpcwire.trailers(e.code, e.details, e.trailing_metadata,
                                                    trailers_only=not s.headers_sent))
        self._write(h2.headers_frames(s.sid, block, True, self.client_max_frame))
        if s.task is not None and s.task is not asyncio.current_task():
            s.task.cancel()
        self.local.pop(s.sid, None)

    def _write(self, data: bytes) -> None:
        # Never write to a transport that is closing: the peer may be gone before
        # connection_lost has run, and uvloop raises there (a "fatal error" that would
        # also close the other side).
        if self.client is not None and not self.client.is_closing():
            self.client.write(data)

    def _wake_window_waiters(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    # ------------------------------------------------------------------ runtime unreachable

    def _start_local(self) -> None:
        data, self._pending = bytes(self._pending), bytearray()
        self._write(h2.settings_frame({h2.SETTINGS_HEADER_TABLE_SIZE: 0}))
        self.relay.watch_for_upstream(self)
        if data:
            self.from_client_local(data)

    def from_client_local(self, data: bytes) -> None:
        """Act as the server: answer every call UNAVAILABLE."""
        buf = self._cbuf + data if self._cbuf else data
        i, n = 0, len(buf)
        if not self._preface_done:
            if not self._take_preface(buf):
                return
            i = 24
        out: list[bytes] = []
        try:
            while n - i >= 9:
                length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
                end = i + 9 + length
                if end > n:
                    break
                ftype, flags = buf[i + 3], buf[i + 4]
                sid = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
                payload = buf[i + 9:end]
                i = end
                if ftype == h2.SETTINGS and not flags & h2.ACK:
                    self._client_settings(payload)
                    out.append(h2.frame(h2.SETTINGS, h2.ACK, 0))
                elif ftype == h2.PING and not flags & h2.ACK:
                    out.append(h2.frame(h2.PING, h2.ACK, 0, payload))
                elif ftype == h2.DATA and length:
                    out.append(h2.window_update(0, length))
                elif ftype in (h2.HEADERS, h2.CONTINUATION):
                    fragment = h2.header_block_fragment(ftype, flags, payload) if ftype == h2.HEADERS else payload
                    self._header_fragments.append(fragment)
                    if flags & h2.END_HEADERS:
                        block = b"".join(self._header_fragments)
                        self._header_fragments = []
                        self.decoder.decode(block)
                        if sid > self.last_sid:
                            self.last_sid = sid
                            msg = f"cri-shim: the container runtime at {self.relay.upstream_path} is not reachable"
                            out.append(h2.headers_frames(sid, h2.encode_headers(grpcwire.trailers(
                                grpc.StatusCode.UNAVAILABLE, msg, trailers_only=True)), True, self.client_max_frame))
                    else:
                        self._header_sid = sid
                elif ftype == h2.GOAWAY:
                    pass
        except Exception as e:
            self._protocol_error(e if isinstance(e, H2Error) else H2Error(f"malformed frame: {e!r}"))
            return
        self._cbuf = buf[i:]
        if out:
            self._write(b"".join(out))

    def runtime_back(self) -> None:
        """The runtime is reachable again: send the client off to reconnect."""
        if self.mode == "local" and self.client is not None and not self.client.is_closing():
            self._write(h2.goaway(self.last_sid, h2.NO_ERROR, b"cri-shim: runtime reachable again"))
            self.loop.call_later(0.2, self.client.close)
