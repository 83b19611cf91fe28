"""The relay's protocol core, without I/O: bytes in, bytes and events out.

One ``RelayCore`` per client connection. The asyncio adapter (connection.py) feeds it
what the client sends (``receive_client``) and what the runtime sends
(``receive_runtime``), then writes ``take_client()`` to the client and
``take_runtime()`` to the runtime and acts on ``take_events()``. Everything HTTP/2
(RFC 9113) the shim decides lives here, so it is tested without sockets
(tests/unit/test_relay_core*.py).

Frames pass through unchanged (SETTINGS gain HEADER_TABLE_SIZE=0 and the shim's
MAX_HEADER_LIST_SIZE, see h2.py), so for every method we don't intercept the
runtime's answer reaches the client byte for byte. The runtime judges the relayed
streams; the shim judges what it consumes itself, as containerd (grpc-go on Go's
x/net/http2 framer) would:

- Frame layer, for every frame: length above the advertised MAX_FRAME_SIZE, wrong
  fixed lengths (PING 8, RST_STREAM and WINDOW_UPDATE 4, PRIORITY 5, SETTINGS a
  multiple of 6, ACK empty) -> FRAME_SIZE_ERROR; SETTINGS, PING or GOAWAY on a stream,
  DATA, HEADERS, PRIORITY, RST_STREAM or CONTINUATION on stream 0, any frame but the
  block's CONTINUATION inside an open header block, PUSH_PROMISE from a client,
  an even stream id, bad SETTINGS values, WINDOW_UPDATE 0 on the connection ->
  connection error (GOAWAY with the code, then close).
- Header blocks: at most ``max_header_list_bytes`` buffered (PROTOCOL_ERROR beyond,
  as x/net does) and decoded (the stream is refused with RST_STREAM
  FRAME_SIZE_ERROR, as grpc-go does); HPACK is mirrored so the runtime's decoder
  stays in step.
- Client SETTINGS are checked and take effect on receipt (window and frame size of
  what the shim sends itself); only increases wait for the runtime's ACK, since
  gRPC clients check DATA against the settings they know acknowledged.
- After the shim's GOAWAY, a new stream is refused (REFUSED_STREAM) and never relayed.
- At most ``max_concurrent_streams`` streams (relayed and intercepted) are open at once
  per connection, or fewer if the runtime advertises a lower
  SETTINGS_MAX_CONCURRENT_STREAMS; the SETTINGS the client gets say so, and a new stream
  beyond it is refused (REFUSED_STREAM) and never relayed (more than
  REFUSED_STREAMS_BURST refusals at once or REFUSED_STREAMS_PER_SECOND a second: GOAWAY
  ENHANCE_YOUR_CALM, the client ignores the limit). A relayed stream counts until
  the runtime's END_STREAM or RST_STREAM (or the client's RST_STREAM) passes the shim, so
  while the adapter holds the runtime's answers back for a client that does not read
  them, the calls the runtime holds answers for stay bounded too.
- Streams the shim answers (intercepted calls) have their own state: receive window
  enforced (FLOW_CONTROL_ERROR), DATA refunded in batches, request at most
  its method's limit (memory.py: refused on the message's declared length); at most
  ``max_intercepted_streams`` at once per connection and ``calls.limit`` over all
  connections; a request's header list and body count in ``request_buffer`` from its
  first frame until its handler ends (``handler_ended``), RESOURCE_EXHAUSTED beyond;
  a request not complete within the stall timeout is ended (``expire_incomplete``).
  Frames that arrive for them after the shim answered or refused them are consumed
  and their DATA refunded, never forwarded.

A header block that the shim consumes but that changed the client's HPACK table is
still forwarded to the runtime, with END_STREAM cleared and followed by RST_STREAM
CANCEL: the runtime's table stays in step and it never gets a request body.

Connection-level flow control toward the client is shared between the runtime's
DATA and the shim's own: the core keeps the client's real window, holds the
runtime's DATA in order while it is short, and keeps the part of a client
WINDOW_UPDATE that repays the shim's own DATA.

A client's PING goes to the runtime only if the runtime has sent HEADERS or DATA
since the last PING it got; otherwise the core answers it (gRPC servers count such a
PING as a strike and close the connection after two, also when the data that made
the client PING came from the shim). The PINGs the core answers with no HEADERS or
DATA sent to the client since the previous one are limited to a burst of
LOCAL_PINGS_BURST and LOCAL_PINGS_PER_SECOND after it: beyond, GOAWAY
ENHANCE_YOUR_CALM, as a gRPC server does with "too_many_pings" (a gRPC client's BDP
PINGs follow data and never count).

Without a runtime (unreachable at connect, out of file descriptors, or lost with
local calls still running) the core is the server: it acknowledges SETTINGS and
PING, refunds DATA, and answers every new stream UNAVAILABLE with ``message``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

import grpc

from ..cri.routing import Refusal
from ..observability import logs
from . import grpcwire, h2, memory
from .bucket import TokenBucket
from .h2 import H2Error
from .hpack_decoder import Decoder, HeaderListTooLarge
from .memory import Pool

_log = logs.get("relay")

_FRAME_NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY",
                "WINDOW_UPDATE", "CONTINUATION")
CLOSED_LOCAL_MEMORY = 1024  # ids of streams the shim closed, remembered to consume late frames
# PINGs the shim answers itself: a burst, then a rate (containerd allows far fewer: a
# few per five minutes without data in between, then GOAWAY too_many_pings).
LOCAL_PINGS_BURST = 100
LOCAL_PINGS_PER_SECOND = 10.0
# New streams refused for being over the streams allowed at once: a burst (a client that
# opened streams before it got the limit), then a rate; beyond, GOAWAY ENHANCE_YOUR_CALM
# (a client that ignores the advertised limit costs the shim a header block per stream).
REFUSED_STREAMS_BURST = 1000
REFUSED_STREAMS_PER_SECOND = 100.0


def frame_name(ftype: int) -> str:
    return _FRAME_NAMES[ftype] if ftype < len(_FRAME_NAMES) else f"frame type {ftype}"


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 16 << 20
    max_header_list_bytes: int = 64 << 10
    max_intercepted_streams: int = 100
    max_concurrent_streams: int = 100
    path_cache_bytes: int = 16 << 10
    request_buffer: Pool = field(default_factory=lambda: Pool(64 << 20))  # bytes, all connections
    calls: Pool = field(default_factory=lambda: Pool(1024))  # intercepted calls, all connections
    max_request_bytes: Mapping[str, int] = field(default_factory=dict)  # method name -> bytes


# ------------------------------------------------------------------ events


@dataclass(eq=False)
class LocalStream:
    """A stream the shim answers itself."""

    sid: int
    path: str  # the method in canonical form (methods.canonical); headers hold the client's :path
    headers: list[tuple[bytes, bytes]]
    recv_window: int
    send_window: int
    body: bytearray = field(default_factory=bytearray)
    limit: int = 16 << 20  # bytes its request message may have
    limit_key: str = "server.max_message_bytes"
    opened: float = 0.0  # when its HEADERS arrived (the core's clock)
    trusted: bool = True  # its client's uid is in server.trusted_uids
    budgeted: int = 0  # bytes counted in Limits.request_buffer, until its handler ends
    counted: bool = False  # counted in Limits.calls, until its handler ends
    unrefunded: int = 0
    client_ended: bool = False  # the client sent END_STREAM
    dispatched: bool = False  # a Request event went out
    headers_sent: bool = False
    done: bool = False  # the shim sent END_STREAM or RST_STREAM


@dataclass(frozen=True)
class PrefaceReceived:
    """A valid client preface: time to connect to the runtime."""


@dataclass(frozen=True)
class Request:
    """A complete intercepted request: run its handler."""

    stream: LocalStream


@dataclass(frozen=True)
class Cancelled:
    """The client reset an intercepted stream whose handler may be running."""

    sid: int


@dataclass(frozen=True)
class WindowOpened:
    """Flow-control room grew: local senders may go on."""


@dataclass(frozen=True)
class StreamRefused:
    """A new stream was over the streams allowed at once (``limit``): refused, never relayed."""

    limit: int


@dataclass(frozen=True)
class ConnectionClosed:
    """The connection ends: write what is pending, then close both sides."""

    reason: str
    code: int


Event = PrefaceReceived | Request | Cancelled | WindowOpened | StreamRefused | ConnectionClosed


_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path"))
_REQUIRED_PSEUDO = (b":method", b":scheme", b":path")
_CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                  b"upgrade"))
_UPPER = bytes(range(ord("A"), ord("Z") + 1))


def malformed(fields: list[tuple[bytes, bytes]], trailers: bool = False) -> str:
    """Why a request header (or trailer) section is malformed (RFC 9113 8.2, 8.3), or ""."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if not name or name.translate(None, _UPPER) != name:
            return f"header name {name!r} is not lowercase"
        if name[:1] == b":":
            if trailers:
                return f"pseudo-header {name!r} in trailers"
            if regular:
                return f"pseudo-header {name!r} after a regular header"
            if name not in _REQUEST_PSEUDO:
                return f"pseudo-header {name!r} is not a request pseudo-header"
            if name in seen:
                return f"pseudo-header {name!r} twice"
            if name == b":path" and not value:
                return "empty :path"
            seen.add(name)
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                return f"connection-specific header {name!r}"
    if not trailers:
        for name in _REQUIRED_PSEUDO:
            if name not in seen:
                return f"no {name.decode()} pseudo-header"
    return ""


class RelayCore:
    PREFACE, WAITING, RELAY, LOCAL, CLOSED = "preface", "waiting", "relay", "local", "closed"

    def __init__(self, limits: Limits, route: Callable[[str], str | Refusal | None],
                 clock: Callable[[], float] = time.monotonic, trusted: bool = True) -> None:
        self.limits = limits
        self.trusted = trusted  # the client's uid is in server.trusted_uids (see memory.py)
        self.route = route  # :path -> canonical method to answer locally, a refusal, or None: relay
        self.phase = self.PREFACE
        self.message = ""  # why new streams are answered UNAVAILABLE (LOCAL phase)
        self.to_client: list[bytes] = []
        self.to_runtime: list[bytes] = []
        self.events: list[Event] = []
        self._cbuf = b""
        self._ubuf = b""
        self.decoder = Decoder(max_list_size=limits.max_header_list_bytes, path_cache_bytes=limits.path_cache_bytes)
        # an open client header block
        self._block_sid = 0
        self._block_flags = 0
        self._block_frames: list[bytes] = []
        self._block_fragments: list[bytes] = []
        self._block_bytes = 0
        # streams
        self.last_sid = 0
        self.local: dict[int, LocalStream] = {}
        self._closed_local: dict[int, bool] = {}  # sid -> the client had ended it (END_STREAM or RST_STREAM)
        self._closed_order: deque[int] = deque()
        self.dropped_upstream: set[int] = set()  # streams whose runtime frames are discarded
        self.relayed_open: set[int] = set()
        self.max_streams = limits.max_concurrent_streams  # lowered by the runtime's MAX_CONCURRENT_STREAMS
        self.responding: set[int] = set()  # relayed streams whose response headers went out
        self.going_away = False
        self.goaway_sid = 0
        # settings
        self.max_frame_in = h2.DEFAULT_MAX_FRAME  # what the client may send (advertised by the runtime)
        self.runtime_initial_window = h2.DEFAULT_WINDOW  # the client's initial send window per stream
        self.client_initial_window = h2.DEFAULT_WINDOW
        self.client_max_frame = h2.DEFAULT_MAX_FRAME
        # flow control toward the client (connection level)
        self.client_window = h2.DEFAULT_WINDOW
        self.owed = 0  # bytes of the shim's own DATA the client has not yet refunded
        self._held: deque[bytes] = deque()  # runtime frames waiting for the client's window
        self.held_bytes = 0
        self._runtime_block_open = False  # a runtime header block is open on the client connection
        self._deferred: list[bytes] = []  # local frames waiting for that block to end
        self.deferred_bytes = 0
        self._refund_conn = 0
        self._unacked_client_settings: deque[dict[int, int]] = deque()
        self.runtime_spoke = True  # see the module docstring (PING)
        self._clock = clock
        self._pings = TokenBucket(LOCAL_PINGS_BURST, LOCAL_PINGS_PER_SECOND, clock)
        self._client_got_data = False  # HEADERS or DATA went to the client since its last PING
        self._refusals = TokenBucket(REFUSED_STREAMS_BURST, REFUSED_STREAMS_PER_SECOND, clock)

    # ------------------------------------------------------------------ outputs

    def take_client(self) -> bytes:
        out, self.to_client = self.to_client, []
        return b"".join(out) if len(out) != 1 else out[0]

    def take_runtime(self) -> bytes:
        out, self.to_runtime = self.to_runtime, []
        return b"".join(out) if len(out) != 1 else out[0]

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    @property
    def busy(self) -> bool:
        return bool(self.relayed_open or self.local)

    def _emit(self, data: bytes) -> None:
        """A frame of the shim's own to the client, never inside a runtime header block."""
        if self._runtime_block_open:
            self._deferred.append(data)
            self.deferred_bytes += len(data)
        else:
            self.to_client.append(data)

    # ------------------------------------------------------------------ phases

    def start_relay(self) -> None:
        """The runtime connection is up: relay what the client sent so far."""
        self.phase = self.RELAY
        self.to_runtime.append(h2.PREFACE)
        self._resume()

    def start_local(self, message: str) -> None:
        """No runtime: be the server, answering every call UNAVAILABLE with ``message``."""
        self.phase = self.LOCAL
        self.message = message
        self._emit(h2.settings_frame({h2.SETTINGS_HEADER_TABLE_SIZE: 0,
                                      h2.SETTINGS_MAX_HEADER_LIST_SIZE: self.limits.max_header_list_bytes}))
        self._resume()

    def _resume(self) -> None:
        if self._cbuf:
            data, self._cbuf = self._cbuf, b""
            self.receive_client(data)

    def begin_shutdown(self, debug: bytes = b"cri-shim shutting down") -> None:
        """GOAWAY: streams up to the last one seen go on; newer ones are refused."""
        if self.going_away or self.phase == self.CLOSED:
            return
        self.going_away = True
        self.goaway_sid = self.last_sid
        self._emit(h2.goaway(self.last_sid, h2.NO_ERROR, debug))

    def runtime_lost(self) -> bool:
        """The runtime closed its connection. True: close the client connection now.

        Relayed calls get UNAVAILABLE and the client GOAWAY, so it reconnects for new
        calls. Calls the shim answers itself finish first, unless the runtime left a
        header block half sent (nothing more can be written then).
        """
        if self.phase == self.CLOSED:
            return True
        if not self.local or self._held or self._runtime_block_open:
            self._close(h2.NO_ERROR, "runtime connection closed", log=False)
            return True
        self.phase = self.LOCAL
        self.message = "cri-shim: the runtime closed the connection"
        self.begin_shutdown(b"cri-shim: runtime connection closed")
        for sid in sorted(self.relayed_open):
            self._remember_closed(sid)
            block = h2.encode_headers(grpcwire.trailers(grpc.StatusCode.UNAVAILABLE, self.message,
                                                        trailers_only=sid not in self.responding))
            self._emit(h2.headers_frames(sid, block, True, self.client_max_frame))
        self.relayed_open.clear()
        self.responding.clear()
        return False

    def _close(self, code: int, reason: str, log: bool = True) -> None:
        if self.phase == self.CLOSED:
            return
        self.to_client.append(h2.goaway(self.last_sid, code, reason.encode()[:200]))
        self.phase = self.CLOSED
        for sid, s in self.local.items():
            self._release_unless_dispatched(s)
            if s.dispatched:
                self.events.append(Cancelled(sid))
        self.local.clear()
        self.events.append(ConnectionClosed(reason if log else "", code))

    # ------------------------------------------------------------------ client -> runtime

    def receive_client(self, data: bytes) -> None:
        if self.phase == self.CLOSED:
            return
        buf = self._cbuf + data if self._cbuf else data
        if self.phase == self.PREFACE:
            if len(buf) < 24:
                if h2.PREFACE.startswith(buf):
                    self._cbuf = buf
                    return
                self._close(h2.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            if buf[:24] != h2.PREFACE:
                self._close(h2.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            self.phase = self.WAITING
            self.events.append(PrefaceReceived())
            buf = buf[24:]
        if self.phase == self.WAITING:  # the adapter stops reading until it knows where calls go
            self._cbuf = buf
            return
        try:
            i = self._client_frames(buf)
        except H2Error as e:
            self._close(e.code, str(e))
            return
        except Exception as e:  # malformed input we did not foresee: this connection only
            self._close(h2.PROTOCOL_ERROR, f"malformed frame: {e!r}")
            return
        self._cbuf = buf[i:]
        if self._refund_conn or self.local:
            self._flush_refunds()

    def _client_frames(self, buf: bytes) -> int:
        out = self.to_runtime
        relay = self.phase == self.RELAY
        i, n = 0, len(buf)
        while n - i >= 9:
            length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
            if length > self.max_frame_in:
                raise H2Error(f"{frame_name(buf[i + 3])} frame of {length} bytes, above MAX_FRAME_SIZE "
                              f"{self.max_frame_in}", h2.FRAME_SIZE_ERROR)
            end = i + 9 + length
            if end > n:
                break
            ftype, flags = buf[i + 3], buf[i + 4]
            sid = (buf[i + 5] & 0x7F) << 24 | buf[i + 6] << 16 | buf[i + 7] << 8 | buf[i + 8]
            raw = buf[i:end]
            i = end
            if self._block_sid and (ftype != h2.CONTINUATION or sid != self._block_sid):
                raise H2Error(f"{frame_name(ftype)} on stream {sid} inside the header block of stream "
                              f"{self._block_sid}")
            if ftype == h2.DATA:
                if sid == 0:
                    raise H2Error("DATA on stream 0")
                if flags & h2.PADDED and (length == 0 or raw[9] >= length):
                    raise H2Error("DATA frame padding exceeds its length")
                s = self.local.get(sid)
                if s is not None:
                    self._local_data(s, flags, raw, length)
                elif relay and sid not in self._closed_local:
                    out.append(raw)
                elif not relay and sid > self.last_sid:
                    raise H2Error(f"DATA on idle stream {sid}")
                else:  # a stream the shim answered or refused (or no runtime): consume, refund
                    self._refund_conn += length
                    self._late_frame(sid, "DATA")
            elif ftype == h2.HEADERS or ftype == h2.CONTINUATION:
                self._client_headers(ftype, flags, sid, raw, length)
            elif ftype == h2.WINDOW_UPDATE:
                self._client_window_update(sid, raw, length, relay)
            elif ftype == h2.SETTINGS:
                self._client_settings(flags, sid, raw, length, relay)
            elif ftype == h2.RST_STREAM:
                if length != 4:
                    raise H2Error(f"RST_STREAM frame of {length} bytes", h2.FRAME_SIZE_ERROR)
                if sid == 0:
                    raise H2Error("RST_STREAM on stream 0")
                s = self.local.pop(sid, None)
                if s is not None:
                    self._release_unless_dispatched(s)
                    self._remember_closed(sid, True)  # the client is done with it: later frames are errors
                    if s.dispatched:
                        self.events.append(Cancelled(sid))
                elif sid in self._closed_local:
                    pass
                elif sid > self.last_sid:
                    if not relay:
                        raise H2Error(f"RST_STREAM on idle stream {sid}")
                    out.append(raw)
                elif relay:
                    self.relayed_open.discard(sid)
                    self.responding.discard(sid)
                    out.append(raw)
            elif ftype == h2.PING:
                if length != 8:
                    raise H2Error(f"PING frame of {length} bytes", h2.FRAME_SIZE_ERROR)
                if sid:
                    raise H2Error(f"PING on stream {sid}")
                if flags & h2.ACK:
                    if relay:
                        out.append(raw)
                elif not relay or not self.runtime_spoke:
                    if not self._ping_allowed():
                        raise H2Error(f"too many PINGs: more than {LOCAL_PINGS_BURST} at once or "
                                      f"{LOCAL_PINGS_PER_SECOND:g} a second", h2.ENHANCE_YOUR_CALM)
                    self._emit(h2.frame(h2.PING, h2.ACK, 0, raw[9:]))
                else:
                    self.runtime_spoke = False
                    out.append(raw)
            elif ftype == h2.PRIORITY:
                if length != 5:
                    raise H2Error(f"PRIORITY frame of {length} bytes", h2.FRAME_SIZE_ERROR)
                if sid == 0:
                    raise H2Error("PRIORITY on stream 0")
                if relay and sid not in self.local and sid not in self._closed_local:
                    out.append(raw)
            elif ftype == h2.GOAWAY:
                if sid:
                    raise H2Error(f"GOAWAY on stream {sid}")
                if length < 8:
                    raise H2Error(f"GOAWAY frame of {length} bytes", h2.FRAME_SIZE_ERROR)
                if relay:
                    out.append(raw)
            elif ftype == h2.PUSH_PROMISE:
                raise H2Error("PUSH_PROMISE from a client")
            elif relay:  # extension frames: the runtime ignores them
                out.append(raw)
        return i

    def _ping_allowed(self) -> bool:
        """A token bucket for the PINGs the shim answers itself, as grpc-go counts strikes:
        a PING after the client got HEADERS or DATA (a BDP probe of gRPC clients) is free."""
        if self._client_got_data:
            self._client_got_data = False
            return True
        return self._pings.take()

    def _over_the_limit(self, sid: int, frames: list[bytes], inserted: bool) -> None:
        """A new stream over the streams allowed at once: refused (the client retries it)."""
        if not self._refusals.take():
            raise H2Error(f"too many streams over SETTINGS_MAX_CONCURRENT_STREAMS {self.max_streams} "
                          f"(server.max_concurrent_streams): more than {REFUSED_STREAMS_BURST} at once or "
                          f"{REFUSED_STREAMS_PER_SECOND:g} a second", h2.ENHANCE_YOUR_CALM)
        self._refuse(sid, frames, inserted, h2.REFUSED_STREAM)
        self.events.append(StreamRefused(self.max_streams))

    def _client_window_update(self, sid: int, raw: bytes, length: int, relay: bool) -> None:
        if length != 4:
            raise H2Error(f"WINDOW_UPDATE frame of {length} bytes", h2.FRAME_SIZE_ERROR)
        inc = int.from_bytes(raw[9:13], "big") & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise H2Error("WINDOW_UPDATE with increment 0 on the connection")
            self.client_window += inc
            if self.client_window > h2.MAX_WINDOW:
                raise H2Error("connection window above 2^31-1", h2.FLOW_CONTROL_ERROR)
            repay = min(inc, self.owed)
            self.owed -= repay
            if relay and inc > repay:
                self.to_runtime.append(h2.window_update(0, inc - repay) if repay else raw)
            if self._held:
                self._flush_held()
            if self.local:
                self.events.append(WindowOpened())
            return
        s = self.local.get(sid)
        if s is not None:
            if inc == 0:
                self._reset_local(s, h2.PROTOCOL_ERROR)
                return
            s.send_window += inc
            if s.send_window > h2.MAX_WINDOW:
                self._reset_local(s, h2.FLOW_CONTROL_ERROR)
                return
            self.events.append(WindowOpened())
        elif sid in self._closed_local:
            pass
        elif relay:
            self.to_runtime.append(raw)
        elif sid > self.last_sid:
            raise H2Error(f"WINDOW_UPDATE on idle stream {sid}")

    def _client_settings(self, flags: int, sid: int, raw: bytes, length: int, relay: bool) -> None:
        if sid:
            raise H2Error(f"SETTINGS on stream {sid}")
        if flags & h2.ACK:
            if length:
                raise H2Error(f"SETTINGS ACK with {length} bytes", h2.FRAME_SIZE_ERROR)
            # Every SETTINGS the client got said HEADER_TABLE_SIZE 0: from now on its
            # table may not grow past 0 again (a size update above it is an error).
            self.decoder.allowed_max = 0
            if relay:
                self.to_runtime.append(raw)
            return
        if length % 6:
            raise H2Error(f"SETTINGS frame of {length} bytes", h2.FRAME_SIZE_ERROR)
        payload = raw[9:]
        values: dict[int, int] = {}
        for k in range(0, length, 6):
            key = payload[k] << 8 | payload[k + 1]
            value = int.from_bytes(payload[k + 2:k + 6], "big")
            if key == h2.SETTINGS_ENABLE_PUSH and value > 1:
                raise H2Error(f"SETTINGS_ENABLE_PUSH {value}")
            if key == h2.SETTINGS_INITIAL_WINDOW_SIZE and value > h2.MAX_WINDOW:
                raise H2Error(f"SETTINGS_INITIAL_WINDOW_SIZE {value}", h2.FLOW_CONTROL_ERROR)
            if key == h2.SETTINGS_MAX_FRAME_SIZE and not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                raise H2Error(f"SETTINGS_MAX_FRAME_SIZE {value}")
            values[key] = value
        # In force for what the shim sends from now on, except that an increase waits for
        # the runtime's ACK to reach the client: gRPC clients (grpc-core) check DATA
        # against the values they know acknowledged.
        self._apply_client_settings(values, increases=not relay)
        if relay:
            self._unacked_client_settings.append(values)
        if relay:
            self.to_runtime.append(h2.frame(h2.SETTINGS, flags, 0, h2.with_table_size_zero(payload)))
        else:
            self._emit(h2.frame(h2.SETTINGS, h2.ACK, 0))

    def _apply_client_settings(self, values: dict[int, int], increases: bool) -> None:
        window = values.get(h2.SETTINGS_INITIAL_WINDOW_SIZE)
        if window is not None and (increases or window < self.client_initial_window):
            delta = window - self.client_initial_window
            self.client_initial_window = window
            for s in self.local.values():
                s.send_window += delta
                if s.send_window > h2.MAX_WINDOW:
                    raise H2Error("a stream window above 2^31-1", h2.FLOW_CONTROL_ERROR)
            if self.local:
                self.events.append(WindowOpened())
        frame_size = values.get(h2.SETTINGS_MAX_FRAME_SIZE)
        if frame_size is not None and (increases or frame_size < self.client_max_frame):
            self.client_max_frame = frame_size

    def _client_headers(self, ftype: int, flags: int, sid: int, raw: bytes, length: int) -> None:
        if sid == 0:
            raise H2Error(f"{frame_name(ftype)} on stream 0")
        if ftype == h2.HEADERS:
            self._block_sid, self._block_flags = sid, flags
            fragment = h2.header_block_fragment(ftype, flags, raw[9:])
        elif not self._block_sid:
            raise H2Error(f"CONTINUATION on stream {sid} without an open header block")
        else:
            fragment = raw[9:]
        self._block_bytes += len(fragment)
        if self._block_bytes > self.limits.max_header_list_bytes:
            raise H2Error(f"header block of stream {sid} larger than server.max_header_list_bytes "
                          f"({self.limits.max_header_list_bytes} bytes)")
        self._block_frames.append(raw)
        self._block_fragments.append(fragment)
        if not flags & h2.END_HEADERS:
            return
        frames, fragments = self._block_frames, self._block_fragments
        flags = self._block_flags
        self._block_frames, self._block_fragments, self._block_sid, self._block_bytes = [], [], 0, 0
        block = fragments[0] if len(fragments) == 1 else b"".join(fragments)
        self._header_block(sid, flags, frames, block)

    def _header_block(self, sid: int, flags: int, frames: list[bytes], block: bytes) -> None:
        relay = self.phase == self.RELAY
        if not sid & 1:
            raise H2Error(f"HEADERS on even stream id {sid}")
        if sid <= self.last_sid:  # trailers (or a protocol error the runtime will judge)
            s = self.local.get(sid)
            try:
                _, fields, inserted = self.decoder.decode(block, full=s is not None)
            except HeaderListTooLarge as e:
                fields, inserted = [], e.inserted
            if s is not None or sid in self._closed_local:
                if inserted and relay:
                    raise H2Error(f"header block on stream {sid}, which the shim answered, changed the HPACK "
                                  "table; the runtime never saw that stream", h2.COMPRESSION_ERROR)
                if s is None:
                    self._late_frame(sid, "HEADERS")
                elif s.client_ended:
                    self._reset_local(s, h2.STREAM_CLOSED)
                elif not flags & h2.END_STREAM or malformed(fields, trailers=True):
                    self._reset_local(s, h2.PROTOCOL_ERROR)  # trailers end the stream, without pseudo-headers
                else:
                    s.client_ended = True
                    self._dispatch(s)
                return
            if relay:
                self.to_runtime.extend(frames)
            elif sid not in self.relayed_open:
                raise H2Error(f"HEADERS on closed stream {sid}", h2.STREAM_CLOSED)
            return
        self.last_sid = sid
        snapshot = self.decoder.snapshot()
        try:
            path_b, _, inserted = self.decoder.decode(block)
        except HeaderListTooLarge as e:
            self._refuse(sid, frames, e.inserted, h2.FRAME_SIZE_ERROR)
            return
        if self.going_away and sid > self.goaway_sid:
            self._refuse(sid, frames, inserted, h2.REFUSED_STREAM)
            return
        path = path_b.decode("latin-1") if path_b is not None else None
        if not relay:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.UNAVAILABLE, self.message, flags)
            return
        if len(self.relayed_open) + len(self.local) >= self.max_streams:
            self._over_the_limit(sid, frames, inserted)
            return
        route = self.route(path) if path is not None else None
        if route is None:
            self.relayed_open.add(sid)
            if _log.isEnabledFor(logging.DEBUG):  # log.level: debug names every relayed call
                logs.log(_log, logging.DEBUG, "relayed", method=path or "")
            self.to_runtime.extend(frames)
            return
        self.decoder.restore(snapshot)  # decode again, this time every header
        try:
            _, headers, _ = self.decoder.decode(block, full=True)
        except HeaderListTooLarge:
            self._refuse(sid, frames, inserted, h2.FRAME_SIZE_ERROR)
            return
        problem = malformed(headers)
        if problem:  # RFC 9113 8.1.1: a malformed request is a stream error
            self._refuse(sid, frames, inserted, h2.PROTOCOL_ERROR)
            return
        if isinstance(route, Refusal):  # a service the shim does not serve (shim/cri/routing.py)
            self._answer_only(sid, frames, inserted, route.code, route.message, flags)
            return
        if len(self.local) >= self.limits.max_intercepted_streams:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"cri-shim: more than {self.limits.max_intercepted_streams} intercepted calls at once "
                              "on this connection (server.max_intercepted_streams)", flags)
            return
        refusal = self._admit_call(headers)
        if refusal:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, flags)
            return
        if inserted:
            self._cancel_upstream(sid, frames)
        limit, key = memory.request_limit(self.limits.max_request_bytes, self.limits.max_message_bytes, route)
        s = LocalStream(sid, route, headers, recv_window=self.runtime_initial_window,
                        send_window=self.client_initial_window, limit=limit, limit_key=key,
                        opened=self._clock(), trusted=self.trusted,
                        budgeted=memory.header_bytes(headers), counted=True)
        self.local[sid] = s
        if flags & h2.END_STREAM:
            s.client_ended = True
            self._dispatch(s)

    def _admit_call(self, headers: list[tuple[bytes, bytes]]) -> str:
        """Count a new intercepted call and its header list in the process-wide pools, or say why not."""
        calls, buf = self.limits.calls, self.limits.request_buffer
        whose = "" if self.trusted else " by clients outside server.trusted_uids"
        if not calls.take(1, self.trusted):
            n = calls.limit if self.trusted else calls.untrusted_limit
            return f"cri-shim: more than {n} intercepted calls at once{whose} (server.max_intercepted_calls); retry"
        if not buf.take(memory.header_bytes(headers), self.trusted):
            calls.give(1, self.trusted)
            return self._buffer_full()
        return ""

    def _buffer_full(self) -> str:
        buf = self.limits.request_buffer
        if self.trusted:
            return (f"cri-shim: intercepted requests hold more than server.max_request_buffer_bytes "
                    f"({buf.limit} bytes); retry")
        return (f"cri-shim: intercepted requests of clients outside server.trusted_uids hold more than their share "
                f"of server.max_request_buffer_bytes ({buf.untrusted_limit} bytes); retry")

    def _cancel_upstream(self, sid: int, frames: list[bytes]) -> None:
        """Give the runtime a header block it must decode, on a stream that ends at once."""
        first = frames[0]
        if first[4] & h2.END_STREAM:
            first = first[:4] + bytes((first[4] & ~h2.END_STREAM,)) + first[5:]
        self.to_runtime.append(first)
        self.to_runtime.extend(frames[1:])
        self.to_runtime.append(h2.rst_stream(sid, h2.CANCEL))
        self.dropped_upstream.add(sid)

    def _refuse(self, sid: int, frames: list[bytes], inserted: bool, code: int) -> None:
        if inserted and self.phase == self.RELAY:
            self._cancel_upstream(sid, frames)
        self._remember_closed(sid)
        self._emit(h2.rst_stream(sid, code))

    def _answer_only(self, sid: int, frames: list[bytes], inserted: bool, code: grpc.StatusCode, message: str,
                     flags: int) -> None:
        """Answer a new stream with a status at once (its request is not needed)."""
        if inserted and self.phase == self.RELAY:
            self._cancel_upstream(sid, frames)
        self._remember_closed(sid, bool(flags & h2.END_STREAM))
        block = h2.encode_headers(grpcwire.trailers(code, message, trailers_only=True))
        self._client_got_data = True
        self._emit(h2.headers_frames(sid, block, True, self.client_max_frame))
        if not flags & h2.END_STREAM:  # the client may still be sending: it can stop
            self._emit(h2.rst_stream(sid, h2.NO_ERROR))

    def _remember_closed(self, sid: int, client_ended: bool = False) -> None:
        if sid not in self._closed_local:
            self._closed_order.append(sid)
        self._closed_local[sid] = client_ended
        if len(self._closed_order) > CLOSED_LOCAL_MEMORY:
            old = self._closed_order.popleft()
            self._closed_local.pop(old, None)
            self.dropped_upstream.discard(old)

    def _late_frame(self, sid: int, what: str) -> None:
        """DATA or HEADERS for a stream the shim closed: fine if the client had not ended it
        (it had not seen our answer yet); after its own END_STREAM, STREAM_CLOSED."""
        if self._closed_local.get(sid):
            self._emit(h2.rst_stream(sid, h2.STREAM_CLOSED))

    # ------------------------------------------------------------------ intercepted streams: receiving

    def _local_data(self, s: LocalStream, flags: int, raw: bytes, length: int) -> None:
        self._refund_conn += length
        if s.client_ended:
            self._reset_local(s, h2.STREAM_CLOSED)
            return
        if length > s.recv_window:
            self._reset_local(s, h2.FLOW_CONTROL_ERROR)
            return
        s.recv_window -= length
        s.unrefunded += length
        body = h2.data_payload(flags, raw[9:])
        have = len(s.body)
        if have < 5 <= have + len(body):  # the message prefix: its declared length, before buffering it
            declared = int.from_bytes((bytes(s.body) + body[:5 - have])[1:5], "big")
            if declared > s.limit:
                self.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED, memory.too_large(declared, s.limit,
                                                                                          s.limit_key))
                return
        if have + len(body) > s.limit + 5:
            self.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              memory.too_large(have + len(body) - 5, s.limit, s.limit_key))
            return
        if not self.charge(s, len(body)):
            self.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED, self._buffer_full())
            return
        s.body += body
        if flags & h2.END_STREAM:
            s.client_ended = True
            self._dispatch(s)

    def _flush_refunds(self) -> None:
        """WINDOW_UPDATEs for the DATA the shim consumed in this batch."""
        out = []
        if self._refund_conn:
            out.append(h2.window_update(0, self._refund_conn))
            self._refund_conn = 0
        for s in self.local.values():
            if s.unrefunded:
                if not s.client_ended:
                    out.append(h2.window_update(s.sid, s.unrefunded))
                    s.recv_window += s.unrefunded
                s.unrefunded = 0
        if out:
            self._emit(b"".join(out))

    def _dispatch(self, s: LocalStream) -> None:
        if not s.dispatched and not s.done:  # the request stays counted until handler_ended(s)
            s.dispatched = True
            self.events.append(Request(s))

    def charge(self, s: LocalStream, n: int) -> bool:
        """Count ``n`` more bytes of ``s``'s request in the process-wide buffer, if they fit."""
        if not self.limits.request_buffer.take(n, s.trusted):
            return False
        s.budgeted += n
        return True

    def handler_ended(self, s: LocalStream) -> None:
        """``s``'s handler is done (answered, failed or cancelled): what it held is free."""
        self._release(s)

    def _release(self, s: LocalStream) -> None:
        if s.budgeted:
            self.limits.request_buffer.give(s.budgeted, s.trusted)
            s.budgeted = 0
        if s.counted:
            self.limits.calls.give(1, s.trusted)
            s.counted = False

    def _release_unless_dispatched(self, s: LocalStream) -> None:
        """A stream ends: what it held is free now, unless its handler runs (handler_ended)."""
        if not s.dispatched:
            self._release(s)

    def expire_incomplete(self, older_than: float, seconds: float) -> float | None:
        """End the intercepted requests still incomplete that began before ``older_than``
        (their body does not arrive). Returns when the oldest remaining one began, or None."""
        oldest = None
        for s in list(self.local.values()):
            if s.client_ended or s.dispatched:
                continue
            if s.opened <= older_than:
                self.answer_error(s, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"cri-shim: request not complete within {seconds:g} s (server.stream_stall_seconds)")
            elif oldest is None or s.opened < oldest:
                oldest = s.opened
        return oldest

    @property
    def incomplete(self) -> bool:
        """An intercepted request is still being received."""
        return any(not s.client_ended and not s.dispatched for s in self.local.values())

    def reset(self, s: LocalStream, code: int = h2.CANCEL) -> None:
        """End an intercepted stream with RST_STREAM (e.g. its answer is stalled on the client's window)."""
        if self.local.get(s.sid) is s:
            self._reset_local(s, code)

    def _reset_local(self, s: LocalStream, code: int) -> None:
        """A stream error on an intercepted stream: RST_STREAM, handler cancelled."""
        self._release_unless_dispatched(s)
        self.local.pop(s.sid, None)
        self._remember_closed(s.sid)  # after our RST_STREAM, late frames are ignored
        if not s.done:
            s.done = True
            self._emit(h2.rst_stream(s.sid, code))
        if s.dispatched:
            self.events.append(Cancelled(s.sid))

    # ------------------------------------------------------------------ intercepted streams: answering

    def send_headers(self, s: LocalStream) -> None:
        if not s.done and not s.headers_sent:
            s.headers_sent = True
            self._emit(h2.headers_frames(s.sid, h2.encode_headers(grpcwire.RESPONSE_HEADERS), False,
                                         self.client_max_frame))

    def send_room(self, s: LocalStream) -> int:
        """Bytes of DATA the shim may send on ``s`` now (0: wait for WindowOpened)."""
        if self._held or self._runtime_block_open:
            return 0
        return max(0, min(self.client_window, s.send_window, self.client_max_frame))

    def send_data(self, s: LocalStream, chunk: bytes) -> None:
        """One DATA frame; ``len(chunk)`` at most ``send_room(s)``."""
        n = len(chunk)
        self.client_window -= n
        s.send_window -= n
        self.owed += n
        self._client_got_data = True
        self.to_client.append(h2.frame(h2.DATA, 0, s.sid, chunk))

    def send_trailers(self, s: LocalStream, headers: list[tuple[bytes, bytes]]) -> None:
        if s.done:
            return
        s.done = True
        if not s.headers_sent:
            headers = list(grpcwire.RESPONSE_HEADERS) + headers
        self._client_got_data = True
        self._emit(h2.headers_frames(s.sid, h2.encode_headers(headers), True, self.client_max_frame))
        self._finish(s)

    def answer_error(self, s: LocalStream, code: grpc.StatusCode, message: str,
                     md: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        if s.done:
            return
        s.done = True
        block = h2.encode_headers(grpcwire.trailers(code, message, md, trailers_only=not s.headers_sent))
        self._client_got_data = True
        self._emit(h2.headers_frames(s.sid, block, True, self.client_max_frame))
        if not s.client_ended:  # still sending: tell it to stop (its later frames are consumed)
            self._emit(h2.rst_stream(s.sid, h2.NO_ERROR))
        self._finish(s)

    def _finish(self, s: LocalStream) -> None:
        self._release_unless_dispatched(s)
        if self.local.get(s.sid) is s:
            del self.local[s.sid]
            self._remember_closed(s.sid, s.client_ended)

    def release_all(self) -> None:
        """The connection is gone: what its streams held goes back to the process pools
        (a stream whose handler runs gives it back when the handler ends)."""
        for s in self.local.values():
            self._release_unless_dispatched(s)
        self.local.clear()

    def stream_gone(self, s: LocalStream) -> bool:
        return self.phase == self.CLOSED or self.local.get(s.sid) is not s

    # ------------------------------------------------------------------ runtime -> client

    def receive_runtime(self, data: bytes) -> None:
        if self.phase == self.CLOSED:
            return
        buf = self._ubuf + data if self._ubuf else data
        out = self.to_client
        held = self._held
        i, n = 0, len(buf)
        while n - i >= 9:
            length = buf[i] << 16 | buf[i + 1] << 8 | buf[i + 2]
            end = i + 9 + length
            if end > n:
                break
            ftype, flags = buf[i + 3], buf[i + 4]
            sid = (buf[i + 5] & 0x7F) << 24 | buf[i + 6] << 16 | buf[i + 7] << 8 | buf[i + 8]
            raw = buf[i:end]
            i = end
            if ftype == h2.HEADERS or ftype == h2.DATA:
                self.runtime_spoke = True
                if ftype == h2.HEADERS and sid in self.relayed_open:
                    self.responding.add(sid)
            if sid and sid in self.dropped_upstream:
                # The shim answers (or refused) this stream; the runtime only had to decode its
                # header block. grpc-go may answer it before it reads our RST_STREAM (trailers,
                # then RST_STREAM NO_ERROR): none of that is the client's. Its RST_STREAM is the
                # last frame it sends on the stream; older entries go with the closed-stream memory.
                if ftype == h2.RST_STREAM:
                    self.dropped_upstream.discard(sid)
                if ftype == h2.DATA and length:  # the client never sees it: the runtime gets its window back
                    self.to_runtime.append(h2.window_update(0, length))
                continue
            if ftype == h2.SETTINGS:
                if not flags & h2.ACK:
                    raw = self._runtime_settings(raw)
                elif self._unacked_client_settings:
                    try:
                        self._apply_client_settings(self._unacked_client_settings.popleft(), increases=True)
                    except H2Error as e:
                        self._close(e.code, str(e))
                        return
            elif sid and (ftype == h2.RST_STREAM or (flags & h2.END_STREAM and (ftype == h2.HEADERS
                                                                                 or ftype == h2.DATA))):
                self.relayed_open.discard(sid)
                self.responding.discard(sid)
            if ftype == h2.HEADERS or ftype == h2.DATA:
                self._client_got_data = True
            if ftype == h2.DATA and length:
                if held or self.client_window < length:
                    held.append(raw)
                    self.held_bytes += len(raw)
                    continue
                self.client_window -= length
            elif held:
                held.append(raw)
                self.held_bytes += len(raw)
                continue
            if ftype == h2.HEADERS or ftype == h2.CONTINUATION:
                self._runtime_block(flags, raw, out)
                continue
            out.append(raw)
        self._ubuf = buf[i:]

    def _runtime_block(self, flags: int, raw: bytes, out: list[bytes]) -> None:
        out.append(raw)
        if flags & h2.END_HEADERS:
            self._runtime_block_open = False
            if self._deferred:
                out.extend(self._deferred)
                self._deferred = []
                self.deferred_bytes = 0
            if self.local:
                self.events.append(WindowOpened())
        else:
            self._runtime_block_open = True

    def _runtime_settings(self, raw: bytes) -> bytes:
        payload = raw[9:]
        values = h2.settings_payload(payload)
        if h2.SETTINGS_MAX_FRAME_SIZE in values:
            self.max_frame_in = max(h2.DEFAULT_MAX_FRAME, min(values[h2.SETTINGS_MAX_FRAME_SIZE], h2.MAX_FRAME_LIMIT))
        if h2.SETTINGS_INITIAL_WINDOW_SIZE in values:
            new = values[h2.SETTINGS_INITIAL_WINDOW_SIZE]
            delta = new - self.runtime_initial_window
            self.runtime_initial_window = new
            for s in self.local.values():
                s.recv_window += delta
        if h2.SETTINGS_MAX_CONCURRENT_STREAMS in values:  # in force until the runtime changes it again
            self.max_streams = min(self.limits.max_concurrent_streams, values[h2.SETTINGS_MAX_CONCURRENT_STREAMS])
        payload = h2.with_table_size_zero(payload, self.limits.max_header_list_bytes)
        return h2.frame(h2.SETTINGS, 0, 0, payload + h2.setting(h2.SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams))

    def _flush_held(self) -> None:
        out = self.to_client
        while self._held:
            raw = self._held[0]
            if raw[3] == h2.DATA:
                length = len(raw) - 9
                if length > self.client_window:
                    break
                self.client_window -= length
            self._held.popleft()
            self.held_bytes -= len(raw)
            if raw[3] == h2.HEADERS or raw[3] == h2.CONTINUATION:
                self._runtime_block(raw[4], raw, out)
            else:
                out.append(raw)
