"""The streams the shim answers itself (intercepted calls): requests in, answers out.

``RelayCore`` opens an intercepted stream (``LocalStream``, streams.py) when routing
says so and gives it here its DATA; the adapter (connection.py) answers through
``RelayCore.calls``. The rules:

- The stream's receive window is enforced (FLOW_CONTROL_ERROR); DATA after the
  client's END_STREAM is STREAM_CLOSED.
- A request is at most its method's limit (memory.py ``request_limit``): refused on the
  message's declared length, before it is buffered (RESOURCE_EXHAUSTED, grpc-go's words).
- A request's header list and body count in the process-wide request buffer from its
  first frame until its handler ends (``handler_ended``), RESOURCE_EXHAUSTED beyond; a
  request not complete within the stall timeout is ended (``expire_incomplete``).
- Answers: response HEADERS, DATA within ``send_room`` (the client's connection and
  stream windows, the largest frame it takes), trailers; or an error status at once
  (trailers-only if no HEADERS went out, then RST_STREAM NO_ERROR if the client is
  still sending); or RST_STREAM (``reset``: the handler is cancelled).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from . import grpcwire, http2, memory
from .carried import Carried
from .events import Cancelled, Event, Request
from .flow import ClientWindow
from .output import ClientOutput
from .pings import PingPolicy
from .settings import PeerSettings
from .streams import Event as On
from .streams import LocalStream, State, StreamTable


class Intercepted:
    __slots__ = ("budget", "ended", "events", "output", "pings", "settings", "streams", "window")

    def __init__(self, streams: StreamTable, budget: memory.Budget, window: ClientWindow, settings: PeerSettings,
                 pings: PingPolicy, output: ClientOutput, events: list[Event], ended: Callable[[], None]) -> None:
        self.streams, self.budget, self.window, self.settings = streams, budget, window, settings
        self.pings, self.output, self.events = pings, output, events
        self.ended = ended  # called when the shim ends a stream: runtime frames held for it may go (carried.py)

    # ------------------------------------------------------------------ receiving

    def receive_data(self, s: LocalStream, flags: int, raw: bytes, length: int) -> None:
        """A DATA frame (``raw``, header included) on the open stream ``s``."""
        if s.client_ended:
            self.reset(s, http2.STREAM_CLOSED)
            return
        if length > s.recv_window:
            self.reset(s, http2.FLOW_CONTROL_ERROR)
            return
        s.recv_window -= length
        s.unrefunded += length
        body = http2.data_payload(flags, raw[9:])
        problem = memory.body_too_large(s.body, body, s.limit, s.limit_key)
        if problem:
            self.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED, problem)
            return
        if not self.budget.charge(s, len(body)):
            self.answer_error(s, grpc.StatusCode.RESOURCE_EXHAUSTED, self.budget.full(s.trusted))
            return
        s.body += body
        if flags & http2.END_STREAM:
            self.request_complete(s)

    def request_complete(self, s: LocalStream) -> None:
        """The client ended ``s``'s request: its handler runs (``Request``); the request
        stays counted until handler_ended(s)."""
        if s.state is State.RECEIVING:
            self.streams.local_event(s, On.CLIENT_END)
            self.events.append(Request(s))

    def charge(self, s: LocalStream, n: int) -> bool:
        """Count ``n`` more bytes of ``s``'s request in the process-wide buffer, if they fit."""
        return self.budget.charge(s, n)

    def handler_ended(self, s: LocalStream) -> None:
        """``s``'s handler is done (answered, failed or cancelled): what it held is free."""
        self.budget.release(s)

    def expire_incomplete(self, older_than: float, seconds: float) -> float | None:
        """End the intercepted requests still incomplete that began before ``older_than``
        (their body does not arrive). Returns when the oldest remaining one began, or None."""
        oldest = None
        for s in list(self.streams.local.values()):
            if s.state is not State.RECEIVING:
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
        return any(s.state is State.RECEIVING for s in self.streams.local.values())

    def reset(self, s: LocalStream, code: int = http2.CANCEL) -> None:
        """End an open intercepted stream with RST_STREAM (a stream error, or its answer is
        stalled on the client's window): its handler is cancelled."""
        if self.streams.local.get(s.sid) is not s:
            return
        was = self.streams.local_event(s, On.SHIM_RESET)  # after our RST_STREAM, late frames are ignored
        self.output.emit(http2.rst_stream(s.sid, code))
        if was is State.RECEIVING:
            self.budget.release(s)
        else:
            self.events.append(Cancelled(s.sid))
        self.ended()

    def release_all(self) -> None:
        """The connection is gone: what its streams held goes back to the process pools
        (a stream whose handler runs gives it back when the handler ends)."""
        local = self.streams.local
        for s in local.values():
            if s.state is State.RECEIVING:
                self.budget.release(s)
        local.clear()

    # ------------------------------------------------------------------ answering

    def send_headers(self, s: LocalStream) -> None:
        if s.state is State.HANDLING:
            self.streams.local_event(s, On.SHIM_HEADERS)
            self.output.emit(http2.headers_frames(s.sid, http2.encode_headers(grpcwire.RESPONSE_HEADERS), False,
                                               self.settings.client_max_frame))

    def send_room(self, s: LocalStream) -> int:
        """Bytes of DATA the shim may send on ``s`` now (0: wait for WindowOpened)."""
        held = self.window.held
        if self.output.runtime_block_open or (held and not (type(held[0]) is Carried and held[0].sid == s.sid)):
            return 0  # behind held frames; but a runtime header block held until this answer ends must not stop it
        window = self.window
        return max(0, min(window.window, s.send_window, self.settings.client_max_frame))

    def send_data(self, s: LocalStream, chunk: bytes) -> None:
        """One DATA frame; ``len(chunk)`` at most ``send_room(s)``."""
        n = len(chunk)
        self.window.spend_own(n)
        s.send_window -= n
        self.pings.client_got_data = True
        self.output.frames.append(http2.frame(http2.DATA, 0, s.sid, chunk))

    def send_trailers(self, s: LocalStream, headers: list[tuple[bytes, bytes]]) -> None:
        if s.done:
            return
        was = self.streams.local_event(s, On.SHIM_END)
        if was is not State.ANSWERING:
            headers = list(grpcwire.RESPONSE_HEADERS) + headers
        self.pings.client_got_data = True
        self.output.emit(http2.headers_frames(s.sid, http2.encode_headers(headers), True,
                                              self.settings.client_max_frame))
        if was is State.RECEIVING:
            self.budget.release(s)
        self.ended()

    def answer_error(self, s: LocalStream, code: grpc.StatusCode, message: str,
                     md: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        if s.done:
            return
        was = self.streams.local_event(s, On.SHIM_END)
        block = http2.encode_headers(grpcwire.trailers(code, message, md, trailers_only=was is not State.ANSWERING))
        self.pings.client_got_data = True
        self.output.emit(http2.headers_frames(s.sid, block, True, self.settings.client_max_frame))
        if was is State.RECEIVING:  # still sending: tell it to stop (its later frames are consumed)
            self.output.emit(http2.rst_stream(s.sid, http2.NO_ERROR))
            self.budget.release(s)
        self.ended()
