"""The relay's protocol core, without I/O: bytes in, bytes and events out.

One ``RelayCore`` per client connection. The asyncio adapter (connection.py) feeds it
what the client sends (``receive_client``) and what the runtime sends
(``receive_runtime``), then writes ``take_client()`` to the client and
``take_runtime()`` to the runtime and acts on ``take_events()`` (events.py).
Everything HTTP/2 (RFC 9113) the shim decides happens here, so it is tested without
sockets (tests/unit/test_relay_core*.py). The core coordinates one object per concept:

- frames.py: the frame buffer and the frame-layer rules for every client frame;
- headers.py: client header blocks (HEADERS + CONTINUATION) and malformed requests;
- hpack_decoder.py: the client's HPACK table, mirrored so the runtime's stays in step;
- settings.py: both peers' SETTINGS, checked and rewritten;
- flow.py: the client's connection window and the shim's refunds;
- streams.py: every stream's state (an explicit transition table);
- patched.py: relayed streams whose response messages the shim rewrites (``Patch``);
- pings.py: which PINGs the shim answers itself, and how many;
- memory.py / limits.py: what intercepted requests may hold (``server.*``).

Frames pass through unchanged, so for every method the shim does not intercept the
runtime's answer reaches the client byte for byte. What the core decides itself (routing,
refused streams, the bounds of intercepted requests, the runtime's PINGs, the server role
without a runtime) is listed in docs/design.md ("What the relay core decides").

It is about 700 lines on purpose: what is left here touches several concepts at once (a new
stream's routing decides its state, its budget, what the runtime gets and what the client
gets), and the two frame loops stay in one function each, as the per-frame hot path.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

import grpc

from ..cri.call import Handler
from ..cri.routing import Intercept, Patch, Refusal
from ..observability import logs
from . import frames as frames_mod
from . import grpcwire, http2, memory
from .bucket import TokenBucket
from .carried import BlockReader, Carried
from .events import (
    Cancelled,
    ConnectionClosed,
    Event,
    PrefaceReceived,
    StreamRefused,
    WindowOpened,
)
from .flow import ClientWindow, Refunds
from .frames import FrameBuffer, frame_name
from .headers import HeaderBlock, malformed
from .hpack_decoder import Decoder, HeaderListTooLarge
from .http2 import (  # frame types and flags by name: one global lookup each on the per-frame path
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    H2Error,
)
from .intercepted import Intercepted
from .limits import Limits
from .output import ClientOutput
from .patched import Patching
from .pings import PingPolicy
from .settings import PeerSettings
from .streams import TRANSITIONS, LocalStream, State, StreamTable
from .streams import Event as On

_log = logs.get("relay")

# New streams refused for being over the streams allowed at once: a burst (a client that
# opened streams before it got the limit), then a rate; beyond, GOAWAY ENHANCE_YOUR_CALM
# (a client that ignores the advertised limit costs the shim a header block per stream).
REFUSED_STREAMS_BURST = 1000
REFUSED_STREAMS_PER_SECOND = 100.0

Route = Callable[[str], Intercept[Handler] | Patch[Handler] | Refusal | None]  # shim/cri/routing.py Router.route


class Phase(enum.Enum):
    PREFACE = "preface"  # waiting for the client's connection preface
    WAITING = "waiting"  # preface received; the adapter connects to the runtime
    RELAY = "relay"  # relaying to the runtime
    LOCAL = "local"  # no runtime: the core is the server (``message``)
    CLOSED = "closed"


# Enum members as module constants for the per-frame path: ``Phase.RELAY`` is an attribute
# lookup on the enum class, ~20 times slower than a global in CPython 3.11.
_PREFACE, _WAITING, _RELAY, _CLOSED = Phase.PREFACE, Phase.WAITING, Phase.RELAY, Phase.CLOSED
_RELAYED = State.RELAYED
_RUNTIME_END = On.RUNTIME_END
# where a relayed stream goes at the runtime's first HEADERS (an open state: it stays in ``relayed``)
_RESPONDING = TRANSITIONS[(State.RELAYED, On.RUNTIME_HEADERS)]
# a HEADERS frame that is a whole header block by itself, its payload the block (HeaderBlock.add's commonest case)
_BLOCK_FLAGS = END_HEADERS | PADDED | PRIORITY_FLAG


class RelayCore:
    def __init__(self, limits: Limits, route: Route, clock: Callable[[], float] = time.monotonic,
                 trusted: bool = True) -> None:
        server = limits.server
        self.limits = limits
        self.trusted = trusted  # the client's uid is in server.trusted_uids (see memory.py)
        self.route = route
        self.phase = Phase.PREFACE
        self.message = ""  # why new streams are answered UNAVAILABLE (LOCAL phase)
        self.output = ClientOutput()  # for the client, in order (output.py)
        self.to_runtime: list[bytes] = []
        self.events: list[Event] = []  # shared with ``calls``: emptied in place, never replaced
        self._from_client = FrameBuffer()
        self._from_runtime = FrameBuffer()
        self.decoder = Decoder(max_list_size=server.max_header_list_bytes, path_cache_bytes=server.path_cache_bytes)
        self.block = HeaderBlock(server.max_header_list_bytes)  # the client's open header block
        self.streams = StreamTable()
        self.settings = PeerSettings(server.max_concurrent_streams, server.max_header_list_bytes)
        self.window = ClientWindow()  # flow control toward the client (connection level)
        self.refunds = Refunds()
        self.pings = PingPolicy(clock)
        self.budget = memory.Budget(limits.request_buffer, limits.calls)
        self.patching = Patching(self.window, self.to_runtime, server.max_message_bytes, limits.calls, trusted)
        # the streams the shim answers; the adapter answers them through it (intercepted.py)
        self.calls = Intercepted(self.streams, self.budget, self.window, self.settings, self.pings, self.output,
                                 self.events, self._answer_ended)
        self._cancelled_block = BlockReader()  # the runtime's header block on a stream cancelled there (carried.py)
        self._emit = self.output.emit  # a frame of the shim's own to the client, in order
        self.going_away = False
        self.goaway_sid = 0
        # the runtime reads slower than the shim writes to it (runtime_reads_slowly): its PINGs
        # go to the client, so the shim adds nothing of its own to what the runtime has not read
        self.runtime_slow = False
        self._clock = clock
        self._refusals = TokenBucket(REFUSED_STREAMS_BURST, REFUSED_STREAMS_PER_SECOND, clock)

    def runtime_reads_slowly(self, slow: bool) -> None:
        """Input from the adapter: the shim's writes to the runtime are above the high mark (True),
        or below the low mark again (False)."""
        self.runtime_slow = slow

    # ------------------------------------------------------------------ outputs

    def take_client(self) -> bytes:
        return self.output.take()

    def take_runtime(self) -> bytes:
        out = self.to_runtime  # emptied in place: patching.py appends to it too
        data = b"".join(out) if len(out) != 1 else out[0]
        out.clear()
        return data

    def take_events(self) -> list[Event]:
        out = self.events[:]
        self.events.clear()
        return out

    @property
    def local(self) -> dict[int, LocalStream]:
        """The open intercepted streams."""
        return self.streams.local

    @property
    def busy(self) -> bool:
        return bool(self.streams.relayed or self.streams.local)

    # ------------------------------------------------------------------ phases

    def start_relay(self) -> None:
        """The runtime connection is up: relay what the client sent so far."""
        self.phase = Phase.RELAY
        self.to_runtime.append(http2.PREFACE)
        self._resume()

    def start_local(self, message: str) -> None:
        """No runtime: be the server, answering every call UNAVAILABLE with ``message``."""
        self.phase = Phase.LOCAL
        self.message = message
        self._emit(http2.settings_frame({http2.SETTINGS_HEADER_TABLE_SIZE: 0,
                                      http2.SETTINGS_MAX_HEADER_LIST_SIZE: self.limits.server.max_header_list_bytes}))
        self.settings.client_tables.append(0)
        self._resume()

    def _resume(self) -> None:
        pending = self._from_client.pending
        if pending:
            self._from_client.pending = b""
            self.receive_client(pending)

    def begin_shutdown(self, debug: bytes = b"cri-shim shutting down") -> None:
        """GOAWAY: streams up to the last one seen go on; newer ones are refused."""
        if self.going_away or self.phase is Phase.CLOSED:
            return
        self.going_away = True
        self.goaway_sid = self.streams.last_sid
        self._emit(http2.goaway(self.streams.last_sid, http2.NO_ERROR, debug))

    def runtime_lost(self) -> bool:
        """The runtime closed its connection. True: close the client connection now.

        Relayed calls get UNAVAILABLE and the client GOAWAY, so it reconnects for new
        calls. Calls the shim answers itself finish first, unless the runtime left a
        header block half sent (nothing more can be written then).
        """
        if self.phase is Phase.CLOSED:
            return True
        streams = self.streams
        if not streams.local or self.window.held or self.output.runtime_block_open:
            self._close(http2.NO_ERROR, "runtime connection closed", log=False)
            return True
        self.phase = Phase.LOCAL
        self.message = "cri-shim: the runtime closed the connection"
        self.begin_shutdown(b"cri-shim: runtime connection closed")
        self.patching.lost()
        for sid in sorted(streams.relayed):
            trailers_only = streams.relayed[sid] is State.RELAYED  # no response headers went out
            streams.relayed_event(sid, On.RUNTIME_LOST)
            block = http2.encode_headers(grpcwire.trailers(grpc.StatusCode.UNAVAILABLE, self.message,
                                                        trailers_only=trailers_only))
            self._emit(http2.headers_frames(sid, block, True, self.settings.client_max_frame))
        return False

    def _close(self, code: int, reason: str, log: bool = True) -> None:
        if self.phase is Phase.CLOSED:
            return
        self.output.frames.append(http2.goaway(self.streams.last_sid, code, reason.encode()[:200]))
        self.phase = Phase.CLOSED
        local = self.streams.local
        for sid, s in local.items():
            if s.state is State.RECEIVING:
                self.budget.release(s)
            else:
                self.events.append(Cancelled(sid))
        local.clear()
        self.events.append(ConnectionClosed(reason if log else "", code))

    # ------------------------------------------------------------------ client -> runtime

    def receive_client(self, data: bytes) -> None:
        if self.phase is _CLOSED:
            return
        pending = self._from_client.pending  # FrameBuffer.join, inline
        buf = pending + data if pending else data
        if self.phase is _PREFACE:
            if len(buf) < 24:
                if http2.PREFACE.startswith(buf):
                    self._from_client.pending = buf
                    return
                self._close(http2.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            if buf[:24] != http2.PREFACE:
                self._close(http2.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            self.phase = Phase.WAITING
            self.events.append(PrefaceReceived())
            buf = buf[24:]
        if self.phase is _WAITING:  # the adapter stops reading until it knows where calls go
            self._from_client.pending = buf
            return
        try:
            i = self._client_frames(buf)
        except H2Error as e:
            self._close(e.code, str(e))
            return
        except Exception as e:  # noqa: BLE001  (malformed input we did not foresee: this connection only)
            self._close(http2.PROTOCOL_ERROR, f"malformed frame: {e!r}")
            return
        self._from_client.pending = buf[i:]  # FrameBuffer.keep, inline
        if self.refunds.conn or self.streams.local:
            out = self.refunds.frames(self.streams.local.values())
            if out:
                self._emit(out)

    def _client_frames(self, buf: bytes) -> int:
        out = self.to_runtime
        relay = self.phase is _RELAY
        streams = self.streams
        local, closed = streams.local, streams.closed
        block = self.block
        block_limit = block.limit
        check = frames_mod.check
        header = frames_mod.HEADER
        max_frame_in = self.settings.max_frame_in  # changes only with the runtime's SETTINGS
        i, n = 0, len(buf)
        while n - i >= 9:
            head, flags, sid = header(buf, i)
            length = head >> 8
            if length > max_frame_in:
                raise H2Error(f"{frame_name(buf[i + 3])} frame of {length} bytes, above MAX_FRAME_SIZE "
                              f"{max_frame_in}", http2.FRAME_SIZE_ERROR)
            end = i + 9 + length
            if end > n:
                break
            ftype = head & 0xFF
            sid &= 0x7FFFFFFF
            raw = buf[i:end]
            i = end
            if block.sid and (ftype != CONTINUATION or sid != block.sid):
                raise H2Error(f"{frame_name(ftype)} on stream {sid} inside the header block of stream "
                              f"{block.sid}")
            if ftype == HEADERS or ftype == CONTINUATION:
                if ftype == HEADERS and flags & _BLOCK_FLAGS == END_HEADERS and sid and length <= block_limit:
                    self._header_block(sid, flags, [raw], raw[9:])  # block.add, inline
                    continue
                complete = block.add(ftype, flags, sid, raw)
                if complete is not None:
                    self._header_block(*complete)
                continue
            # the frame layer (frames.check); the commonest frames that pass it skip the call:
            # DATA on a stream without padding, WINDOW_UPDATE of 4 bytes
            if ftype == DATA:
                if sid == 0 or flags & PADDED:
                    check(ftype, flags, sid, length, raw)
            elif ftype != WINDOW_UPDATE or length != 4:
                check(ftype, flags, sid, length, raw)
            if ftype == DATA:
                s = local.get(sid)
                if s is not None:
                    self.refunds.conn += length
                    self.calls.receive_data(s, flags, raw, length)
                elif relay and sid not in closed:
                    out.append(raw)
                elif not relay and sid > streams.last_sid:
                    raise H2Error(f"DATA on idle stream {sid}")
                else:  # a stream the shim answered or refused (or no runtime): consume, refund
                    self.refunds.conn += length
                    self._late_frame(sid)
            elif ftype == WINDOW_UPDATE:
                self._client_window_update(sid, raw, relay)
            elif ftype == SETTINGS:
                self._client_settings(flags, raw, length, relay)
            elif ftype == RST_STREAM:
                self._client_reset(sid, raw, relay)
            elif ftype == PING:
                if flags & ACK:
                    if relay:
                        out.append(raw)
                elif self.pings.answer_here(relay):
                    self._emit(http2.PING_ACK_HEADER + raw[9:])  # frames.check: a PING's payload is 8 bytes
                else:
                    out.append(raw)
            elif ftype == PRIORITY:
                if relay and sid not in local and sid not in closed:
                    out.append(raw)
            elif relay:  # GOAWAY, and extension frames: the runtime ignores them
                out.append(raw)
        return i

    def _client_reset(self, sid: int, raw: bytes, relay: bool) -> None:
        streams = self.streams
        s = streams.local.get(sid)
        if s is not None:
            # the client is done with it: later frames are errors
            if streams.local_event(s, On.CLIENT_RESET) is State.RECEIVING:
                self.budget.release(s)
            else:
                self.events.append(Cancelled(sid))
            self._answer_ended()
        elif sid in streams.closed:
            pass
        elif sid > streams.last_sid:
            if not relay:
                raise H2Error(f"RST_STREAM on idle stream {sid}")
            self.to_runtime.append(raw)
        elif relay:
            streams.relayed_event(sid, On.CLIENT_RESET)
            self.to_runtime.append(raw)
            if self.patching.streams:
                self.patching.client_reset(sid)
                if self.window.held:  # what was held for it goes no more: what follows may go
                    self._release()

    def _over_the_limit(self, sid: int, frames: list[bytes], inserted: bool) -> None:
        """A new stream over the streams allowed at once: refused (the client retries it)."""
        max_streams = self.settings.max_streams
        if not self._refusals.take():
            raise H2Error(f"too many streams over SETTINGS_MAX_CONCURRENT_STREAMS {max_streams} "
                          f"(server.max_concurrent_streams): more than {REFUSED_STREAMS_BURST} at once or "
                          f"{REFUSED_STREAMS_PER_SECOND:g} a second", http2.ENHANCE_YOUR_CALM)
        self._refuse(sid, frames, inserted, http2.REFUSED_STREAM)
        self.events.append(StreamRefused(max_streams))

    def _client_window_update(self, sid: int, raw: bytes, relay: bool) -> None:
        inc = int.from_bytes(raw[9:13], "big") & 0x7FFFFFFF
        local = self.streams.local
        if sid == 0:
            if inc == 0:
                raise H2Error("WINDOW_UPDATE with increment 0 on the connection")
            window = self.window
            runtimes = window.update(inc)
            if relay and runtimes:
                self.to_runtime.append(raw if runtimes == inc else http2.window_update(0, runtimes))
            if window.held:
                self._release()
            if local:
                self.events.append(WindowOpened())
            return
        s = local.get(sid)
        if s is not None:
            if inc == 0:
                self.calls.reset(s, http2.PROTOCOL_ERROR)
                return
            s.send_window += inc
            if s.send_window > http2.MAX_WINDOW:
                self.calls.reset(s, http2.FLOW_CONTROL_ERROR)
                return
            self.events.append(WindowOpened())
        elif sid in self.streams.closed:
            pass
        elif sid in self.patching.streams:  # absorbed: the shim refunded the runtime already
            if not self.patching.window_update(sid, inc):
                self._reset_patched(sid, http2.FLOW_CONTROL_ERROR if inc else http2.PROTOCOL_ERROR)
            if self.window.held:
                self._release()
        elif relay:
            self.to_runtime.append(raw)
        elif sid > self.streams.last_sid:
            raise H2Error(f"WINDOW_UPDATE on idle stream {sid}")

    def _release(self) -> None:
        """Send what the client's windows let through of the held frames, in order."""
        out = self.output.frames
        for held in self.window.release(self.settings.client_max_frame):
            if held[3] == HEADERS or held[3] == CONTINUATION:
                self._runtime_block(held[4], held)
            else:
                out.append(held)

    def expire_carried(self, stall: float) -> tuple[str, float | None]:
        """An intercepted answer a runtime header block has waited behind for ``stall`` seconds
        (carried.py) ends: RST_STREAM CANCEL to the client, its handler cancelled; the block goes.
        Returns the method it ended ("" if none) and when to look again."""
        held = self.window.held
        head = held[0] if held else None
        if type(head) is not Carried:
            return "", None
        when = head.due(self._clock(), stall)
        if when is not None:
            return "", when
        ended = self.streams.local.get(head.sid)
        if ended is not None:
            self.calls.reset(ended, http2.CANCEL)  # the block goes (_answer_ended)
        else:  # not waiting any more: what follows goes
            self._answer_ended()
        if self.carrying:
            _, when = self.expire_carried(stall)
        return (ended.path if ended is not None else ""), when

    def expire_patched(self, stall: float) -> tuple[str, float | None]:
        """A patched answer waiting for the client's windows for ``stall`` seconds ends: RST_STREAM
        CANCEL both ways. Returns the method it ended ("" if none) and when to look again."""
        s, when = self.patching.stalled(self._clock(), stall)
        if s is None:
            return "", when
        if not s.ended:
            self.to_runtime.append(http2.rst_stream(s.sid, http2.CANCEL))
        self.patching.discard(s)
        self.streams.relayed_event(s.sid, On.SHIM_RESET)
        # its answer waited at the head of the held frames: the RST_STREAM goes first, so the runtime's
        # trailers held behind it reach a stream already reset (decoded for HPACK, ignored), and the
        # client's call ends CANCELLED, not with trailers and no message
        self._emit(http2.rst_stream(s.sid, http2.CANCEL))
        self._release()
        _, when = self.patching.stalled(self._clock(), stall)
        return s.method, when

    def _send_in_order(self, frames: bytes) -> None:
        """Frames of the shim's own that must follow the runtime's frames held so far."""
        if self.window.held:
            self.window.hold(frames)
        else:
            self._emit(frames)

    def _reset_patched(self, sid: int, code: int) -> None:
        """A stream error on a patched stream: both sides reset it."""
        s = self.patching.streams[sid]
        self.to_runtime.append(http2.rst_stream(sid, http2.CANCEL))
        self.patching.discard(s)
        self.streams.relayed_event(sid, On.SHIM_RESET)
        if self.window.held:
            self._release()
        self._send_in_order(http2.rst_stream(sid, code))

    def _client_settings(self, flags: int, raw: bytes, length: int, relay: bool) -> None:
        if flags & ACK:
            # The client acknowledged the oldest SETTINGS it got (each names a table size):
            # its table toward the runtime may not grow past that size (an update above it
            # is an error).
            tables = self.settings.client_tables
            if tables:
                self.decoder.allowed_max = tables.popleft()
            if relay:
                self.to_runtime.append(raw)
            return
        payload = raw[9:]
        values = PeerSettings.client_values(payload, length)
        # In force for what the shim sends from now on, except that an increase waits for
        # the runtime's ACK to reach the client (settings.py).
        self._apply_client_settings(values, increases=not relay)
        if relay:
            self.settings.unacked.append(values)
            self.to_runtime.append(raw)
        else:
            self._emit(http2.frame(SETTINGS, ACK, 0))

    def _apply_client_settings(self, values: dict[int, int], increases: bool) -> None:
        delta = self.settings.apply_client(values, increases)
        local = self.streams.local
        if delta is not None and self.patching.streams:
            self.patching.initial_window_changed(delta)
            if self.window.held:
                self._release()
        if delta is not None:
            for s in local.values():
                s.send_window += delta
                if s.send_window > http2.MAX_WINDOW:
                    raise H2Error("a stream window above 2^31-1", http2.FLOW_CONTROL_ERROR)
            if local:
                self.events.append(WindowOpened())

    def _header_block(self, sid: int, flags: int, frames: list[bytes], block: bytes) -> None:
        relay = self.phase is _RELAY
        streams = self.streams
        if not sid & 1:
            raise H2Error(f"HEADERS on even stream id {sid}")
        if sid <= streams.last_sid:  # trailers (or a protocol error the runtime will judge)
            self._trailers(sid, flags, frames, block, relay)
            return
        streams.last_sid = sid
        decoder = self.decoder
        try:
            path_b, before = decoder.path_of(block)
        except HeaderListTooLarge as e:
            self._refuse(sid, frames, e.inserted, http2.FRAME_SIZE_ERROR)
            return
        inserted = before is not None  # the block changed the client's HPACK table
        if self.going_away and sid > self.goaway_sid:
            self._refuse(sid, frames, inserted, http2.REFUSED_STREAM)
            return
        path = path_b.decode("latin-1") if path_b is not None else None
        if not relay:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.UNAVAILABLE, self.message, flags)
            return
        if streams.open >= self.settings.max_streams:
            self._over_the_limit(sid, frames, inserted)
            return
        route = self.route(path) if path is not None else None  # the one routing decision of the call
        if type(route) is Patch:
            refusal = self.budget.admit_call(self.trusted)  # its answer is held here: counted like a call
            if refusal:
                self._answer_only(sid, frames, inserted, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, flags)
                return
        if route is None or type(route) is Patch:
            streams.relay(sid)
            if _log.isEnabledFor(logging.DEBUG):  # log.level: debug names every relayed call
                logs.log(_log, logging.DEBUG, "relayed", method=path or "")
            self.to_runtime.extend(frames)
            if route is not None:  # relayed; its response messages rewritten (patched.py), after its HEADERS
                self.patching.open(sid, route.method, route.rewrite, self.settings.client_initial_window)
            return
        if before is not None:
            decoder.restore(before)  # decode again, this time every header
        try:
            _, headers, _ = decoder.decode(block, full=True)
        except HeaderListTooLarge:
            self._refuse(sid, frames, inserted, http2.FRAME_SIZE_ERROR)
            return
        if malformed(headers):  # RFC 9113 8.1.1: a malformed request is a stream error
            self._refuse(sid, frames, inserted, http2.PROTOCOL_ERROR)
            return
        if isinstance(route, Refusal):  # a service the shim does not serve (shim/cri/routing.py)
            self._answer_only(sid, frames, inserted, route.code, route.message, flags)
            return
        server = self.limits.server
        if len(streams.local) >= server.max_intercepted_streams:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"cri-shim: more than {server.max_intercepted_streams} intercepted calls at once "
                              "on this connection (server.max_intercepted_streams)", flags)
            return
        refusal = self.budget.admit(headers, self.trusted)
        if refusal:
            self._answer_only(sid, frames, inserted, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, flags)
            return
        if inserted:
            self._cancel_upstream(sid, frames)
        limit, key = memory.request_limit(self.limits.max_request_bytes, server.max_message_bytes, route.method)
        s = LocalStream(sid, route.method, route.handler, headers, recv_window=self.settings.runtime_initial_window,
                        send_window=self.settings.client_initial_window, limit=limit, limit_key=key,
                        opened=self._clock(), trusted=self.trusted, budgeted=memory.header_bytes(headers),
                        counted=True)
        streams.local[sid] = s
        if flags & END_STREAM:
            self.calls.request_complete(s)

    def _trailers(self, sid: int, flags: int, frames: list[bytes], block: bytes, relay: bool) -> None:
        """A header block on a stream already opened."""
        streams = self.streams
        s = streams.local.get(sid)
        try:
            _, fields, inserted = self.decoder.decode(block, full=s is not None)
        except HeaderListTooLarge as e:
            fields, inserted = [], e.inserted
        if s is not None or sid in streams.closed:
            if inserted and relay:
                raise H2Error(f"header block on stream {sid}, which the shim answered, changed the HPACK "
                              "table; the runtime never saw that stream", http2.COMPRESSION_ERROR)
            if s is None:
                self._late_frame(sid)
            elif s.client_ended:
                self.calls.reset(s, http2.STREAM_CLOSED)
            elif not flags & END_STREAM or malformed(fields, trailers=True):
                self.calls.reset(s, http2.PROTOCOL_ERROR)  # trailers end the stream, without pseudo-headers
            else:
                self.calls.request_complete(s)
            return
        if relay:
            self.to_runtime.extend(frames)
        elif sid not in streams.relayed:
            raise H2Error(f"HEADERS on closed stream {sid}", http2.STREAM_CLOSED)

    def _cancel_upstream(self, sid: int, frames: list[bytes]) -> None:
        """Give the runtime a header block it must decode, on a stream that ends at once."""
        first = frames[0]
        if first[4] & END_STREAM:
            first = first[:4] + bytes((first[4] & ~END_STREAM,)) + first[5:]
        self.to_runtime.append(first)
        self.to_runtime.extend(frames[1:])
        self.to_runtime.append(http2.rst_stream(sid, http2.CANCEL))
        self.streams.drop_runtime.add(sid)

    def _refuse(self, sid: int, frames: list[bytes], inserted: bool, code: int) -> None:
        if inserted and self.phase is Phase.RELAY:
            self._cancel_upstream(sid, frames)
        self.streams.remember(sid, State.ANSWERED)
        self._emit(http2.rst_stream(sid, code))

    def _answer_only(self, sid: int, frames: list[bytes], inserted: bool, code: grpc.StatusCode, message: str,
                     flags: int) -> None:
        """Answer a new stream with a status at once (its request is not needed)."""
        if inserted and self.phase is Phase.RELAY:
            self._cancel_upstream(sid, frames)
        self.streams.remember(sid, State.CLOSED if flags & END_STREAM else State.ANSWERED)
        block = http2.encode_headers(grpcwire.trailers(code, message, trailers_only=True))
        self.pings.client_got_data = True
        self._emit(http2.headers_frames(sid, block, True, self.settings.client_max_frame))
        if not flags & END_STREAM:  # the client may still be sending: it can stop
            self._emit(http2.rst_stream(sid, http2.NO_ERROR))

    def _late_frame(self, sid: int) -> None:
        """DATA or HEADERS for a stream the shim closed: fine if the client had not ended it
        (it had not seen our answer yet); after its own END_STREAM, STREAM_CLOSED."""
        if self.streams.closed.get(sid) is State.CLOSED:
            self._emit(http2.rst_stream(sid, http2.STREAM_CLOSED))

    # ------------------------------------------------------------------ intercepted streams

    def stream_gone(self, s: LocalStream) -> bool:
        return self.phase is Phase.CLOSED or self.streams.local.get(s.sid) is not s

    # ------------------------------------------------------------------ runtime -> client

    def receive_runtime(self, data: bytes) -> None:
        if self.phase is _CLOSED:
            return
        pending = self._from_runtime.pending  # FrameBuffer.join, inline
        buf = pending + data if pending else data
        output = self.output
        out = output.frames
        window = self.window
        held = window.held
        streams = self.streams
        relayed, drop = streams.relayed, streams.drop_runtime
        pings = self.pings
        patched = self.patching.streams
        header = frames_mod.HEADER
        i, n = 0, len(buf)
        while n - i >= 9:
            head, flags, sid = header(buf, i)
            length = head >> 8
            end = i + 9 + length
            if end > n:
                break
            ftype = head & 0xFF
            sid &= 0x7FFFFFFF
            raw = buf[i:end]
            i = end
            if ftype == HEADERS or ftype == DATA:
                pings.runtime_spoke = True
                if ftype == HEADERS and relayed.get(sid) is _RELAYED:
                    relayed[sid] = _RESPONDING  # streams.relayed_event, inline
            if sid and sid in drop:
                # The shim answers (or refused) this stream; the runtime only had to decode its
                # header block. grpc-go may answer it before it reads our RST_STREAM (trailers,
                # then RST_STREAM NO_ERROR): none of that is the client's. Its RST_STREAM is the
                # last frame it sends on the stream; older entries go with the closed-stream memory.
                if ftype == RST_STREAM:
                    drop.discard(sid)
                elif ftype == DATA:
                    if length:  # the client never sees it: the runtime gets its window back
                        self.to_runtime.append(http2.window_update(0, length))
                elif ftype == HEADERS or ftype == CONTINUATION:
                    carry = self._cancelled_block.frame(flags, raw)
                    if carry is not None:  # it changed the HPACK table: the client must decode it too
                        self._carry(sid, carry)
                continue
            if ftype == PING and not flags & ACK and length == 8 and not sid and not self.runtime_slow:
                # The shim answers the runtime's PINGs (grpc-go's BDP probes, one per call,
                # and keepalives): the client would only echo them back.
                self.to_runtime.append(http2.PING_ACK_HEADER + raw[9:])
                continue
            if patched and sid in patched:
                if ftype == DATA:
                    self._patched_data(sid, flags, raw, length)
                    continue
                if ftype == RST_STREAM:
                    if self.patching.runtime_reset(sid):
                        continue  # the client had it ended already
                    if held:  # what was held for it goes no more: the reset may go at once
                        self._release()
                elif ftype == HEADERS and flags & END_STREAM:
                    self.patching.runtime_trailers(sid, out, self.settings.client_max_frame)
            if ftype == SETTINGS:
                if not flags & ACK:
                    raw = self._runtime_settings(raw)
                elif self.settings.unacked:
                    try:
                        self._apply_client_settings(self.settings.unacked.popleft(), increases=True)
                    except H2Error as e:
                        self._close(e.code, str(e))
                        return
            elif (ftype == RST_STREAM or (flags & END_STREAM and (ftype == HEADERS or ftype == DATA))) \
                    and sid in relayed:
                streams.relayed_event(sid, _RUNTIME_END)
            if ftype == HEADERS or ftype == DATA:
                pings.client_got_data = True
            if ftype == DATA and length:
                if held or window.window < length:
                    window.hold(raw)
                    continue
                window.window -= length
            elif held:
                window.hold(raw)
                continue
            if ftype == HEADERS or ftype == CONTINUATION:
                if output.runtime_block(flags, raw) and streams.local:
                    self.events.append(WindowOpened())  # the shim's senders may go on
                continue
            out.append(raw)
        self._from_runtime.pending = buf[i:]  # FrameBuffer.keep, inline

    def _carry(self, sid: int, frames: list[bytes]) -> None:
        """A runtime header block on a stream the shim answers, which changed the HPACK table:
        to the client after the shim's answer (carried.py), in order with the runtime's frames."""
        local = self.streams.local
        if not self.window.held and sid not in local:
            for raw in frames:
                self._runtime_block(raw[4], raw)
            return
        self.window.hold_own(Carried(sid, frames, local))

    @property
    def carrying(self) -> bool:
        """A runtime header block waits at the head of the held frames for the shim's answer (carried.py)."""
        held = self.window.held
        return bool(held) and type(held[0]) is Carried

    def _answer_ended(self) -> None:
        """An intercepted stream ended (the shim's answer, its reset, or the client's): a runtime
        header block held for it may go, and what waited behind it (carried.py)."""
        if self.carrying:
            self._release()
            if self.streams.local:  # the shim's senders that waited behind it may go on
                self.events.append(WindowOpened())

    def _patched_data(self, sid: int, flags: int, raw: bytes, length: int) -> None:
        """The runtime's DATA on a patched stream (patched.py): consumed, refunded, rewritten."""
        self.pings.client_got_data = True
        responding = self.streams.relayed.get(sid) is _RESPONDING
        over = self.patching.data(sid, flags, raw, length, self.output.frames, self.settings.client_max_frame,
                                  responding)
        if over is not None:  # over server.max_message_bytes: the runtime got RST_STREAM CANCEL
            self.streams.relayed_event(sid, On.SHIM_RESET)
            if self.window.held:
                self._release()
            self._send_in_order(http2.headers_frames(sid, over, True, self.settings.client_max_frame))
        elif flags & END_STREAM:
            self.streams.relayed_event(sid, _RUNTIME_END)

    def _runtime_block(self, flags: int, raw: bytes) -> None:
        if self.output.runtime_block(flags, raw) and self.streams.local:
            self.events.append(WindowOpened())  # the shim's senders may go on

    def _runtime_settings(self, raw: bytes) -> bytes:
        forwarded, delta = self.settings.runtime_settings(raw)
        if delta:
            for s in self.streams.local.values():
                s.recv_window += delta
        return forwarded
