"""Per-stream state: an explicit state machine for every stream the shim tracks.

A stream is in one ``State``; it moves only by ``TRANSITIONS`` ((state, event) -> state;
any other pair leaves it as it is: the runtime judges the relayed streams). Where a
stream lives follows from its state:

- ``StreamTable.relayed``: RELAYED, RESPONDING. Open relayed streams (patched ones too:
  patched.py owns what differs, their response DATA; the shim ending one is SHIM_RESET), counted against
  SETTINGS_MAX_CONCURRENT_STREAMS until the runtime's END_STREAM or RST_STREAM (or the
  client's RST_STREAM) passes the shim; then forgotten (GONE): their frames just pass.
- ``StreamTable.local``: RECEIVING, HANDLING, ANSWERING. Streams the shim answers itself
  (``LocalStream``, which holds the state, windows and request body).
- ``StreamTable.closed``: ANSWERED, CLOSED. Streams the shim ended (answered, refused or
  reset), remembered (the newest ``CLOSED_LOCAL_MEMORY``) to consume the frames the
  client sends late: silently after ANSWERED, STREAM_CLOSED for DATA/HEADERS after CLOSED
  (the client had ended the stream itself).

The runtime side of a stream the shim consumed is separate: ``drop_runtime`` holds the
streams whose header block went to the runtime only to keep its HPACK table in step
(then RST_STREAM CANCEL); what the runtime sends on them never reaches the client, but a
header block that changed the runtime's HPACK table (carried.py).
Stream ids above ``last_sid`` are idle.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cri.call import Handler

CLOSED_LOCAL_MEMORY = 1024  # ids of streams the shim closed, remembered to consume late frames


class State(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, in C (Enum's own is Python code)

    RELAYED = "relayed"  # the request went to the runtime; its answer has not begun
    RESPONDING = "responding"  # the runtime's response HEADERS passed to the client
    RECEIVING = "receiving"  # intercepted: its request is still arriving
    HANDLING = "handling"  # intercepted: the client ended its request; the handler runs
    ANSWERING = "answering"  # intercepted: the shim's response HEADERS went out
    ANSWERED = "answered"  # the shim ended it first (answer, refusal or RST_STREAM): late frames consumed
    CLOSED = "closed"  # ended on both sides: a late DATA or HEADERS is STREAM_CLOSED
    GONE = "gone"  # a relayed stream the runtime (or the client's RST_STREAM) ended: not tracked


class Event(enum.Enum):
    __hash__ = object.__hash__

    RUNTIME_HEADERS = "runtime HEADERS"
    RUNTIME_END = "runtime END_STREAM or RST_STREAM"
    RUNTIME_LOST = "runtime connection lost"  # the shim answers UNAVAILABLE for it
    CLIENT_END = "client END_STREAM"
    CLIENT_RESET = "client RST_STREAM"
    SHIM_HEADERS = "shim response HEADERS"
    SHIM_END = "shim trailers (END_STREAM)"
    SHIM_RESET = "shim RST_STREAM"


S, E = State, Event
TRANSITIONS: Mapping[tuple[State, Event], State] = {
    (S.RELAYED, E.RUNTIME_HEADERS): S.RESPONDING,
    (S.RELAYED, E.RUNTIME_END): S.GONE,
    (S.RELAYED, E.CLIENT_RESET): S.GONE,
    (S.RELAYED, E.RUNTIME_LOST): S.ANSWERED,
    (S.RELAYED, E.SHIM_RESET): S.ANSWERED,  # a patched stream the shim ended (patched.py)
    (S.RESPONDING, E.RUNTIME_END): S.GONE,
    (S.RESPONDING, E.CLIENT_RESET): S.GONE,
    (S.RESPONDING, E.RUNTIME_LOST): S.ANSWERED,
    (S.RESPONDING, E.SHIM_RESET): S.ANSWERED,
    (S.RECEIVING, E.CLIENT_END): S.HANDLING,
    (S.RECEIVING, E.CLIENT_RESET): S.CLOSED,
    (S.RECEIVING, E.SHIM_END): S.ANSWERED,
    (S.RECEIVING, E.SHIM_RESET): S.ANSWERED,
    (S.HANDLING, E.SHIM_HEADERS): S.ANSWERING,
    (S.HANDLING, E.SHIM_END): S.CLOSED,
    (S.HANDLING, E.SHIM_RESET): S.ANSWERED,  # after our RST_STREAM, late frames are ignored
    (S.HANDLING, E.CLIENT_RESET): S.CLOSED,
    (S.ANSWERING, E.SHIM_END): S.CLOSED,
    (S.ANSWERING, E.SHIM_RESET): S.ANSWERED,
    (S.ANSWERING, E.CLIENT_RESET): S.CLOSED,
}
del S, E
OPEN_RELAYED = frozenset((State.RELAYED, State.RESPONDING))
_GONE = State.GONE  # a global: Enum attribute lookups are slow on the per-frame path
OPEN_LOCAL = frozenset((State.RECEIVING, State.HANDLING, State.ANSWERING))
ENDED = frozenset((State.ANSWERED, State.CLOSED))


@dataclass(eq=False)
class LocalStream:
    """A stream the shim answers itself."""

    sid: int
    path: str  # the method in canonical form (methods.canonical); headers hold the client's :path
    handler: Handler  # routed once, at its HEADERS (shim/cri/routing.py)
    headers: list[tuple[bytes, bytes]]
    recv_window: int
    send_window: int
    body: bytearray = field(default_factory=bytearray)
    limit: int = 0  # bytes its request message may have (memory.request_limit)
    limit_key: str = "server.max_message_bytes"
    opened: float = 0.0  # when its HEADERS arrived (the core's clock)
    trusted: bool = True  # its client's uid is in server.trusted_uids
    budgeted: int = 0  # bytes counted in Limits.request_buffer, until its handler ends
    counted: bool = False  # counted in Limits.calls, until its handler ends
    unrefunded: int = 0
    state: State = State.RECEIVING

    @property
    def client_ended(self) -> bool:
        """The client sent END_STREAM (the request is complete and dispatched)."""
        return self.state is State.HANDLING or self.state is State.ANSWERING or self.state is State.CLOSED

    @property
    def done(self) -> bool:
        """The shim sent END_STREAM or RST_STREAM (or the client reset it)."""
        return self.state is State.ANSWERED or self.state is State.CLOSED


class StreamTable:
    """Every stream of one connection the shim tracks, by state (see the module docstring)."""

    __slots__ = ("closed", "drop_runtime", "last_sid", "local", "relayed")

    def __init__(self) -> None:
        self.relayed: dict[int, State] = {}
        self.local: dict[int, LocalStream] = {}
        self.closed: dict[int, State] = {}  # oldest first
        self.drop_runtime: set[int] = set()
        self.last_sid = 0

    @property
    def open(self) -> int:
        """Streams counted against the streams allowed at once."""
        return len(self.relayed) + len(self.local)

    def relay(self, sid: int) -> None:
        self.relayed[sid] = State.RELAYED

    def relayed_event(self, sid: int, event: Event) -> None:
        """``event`` on ``sid`` if it is an open relayed stream."""
        state = self.relayed.get(sid)
        if state is None:
            return
        new = TRANSITIONS.get((state, event), state)
        if new is state:
            return
        if new in OPEN_RELAYED:
            self.relayed[sid] = new
            return
        del self.relayed[sid]
        if new is not _GONE:
            self.remember(sid, new)

    def local_event(self, s: LocalStream, event: Event) -> State:
        """``event`` on the intercepted stream ``s``; returns the state it was in."""
        old = s.state
        new = s.state = TRANSITIONS.get((old, event), old)
        if new in ENDED and old not in ENDED and self.local.get(s.sid) is s:
            del self.local[s.sid]
            self.remember(s.sid, new)
        return old

    def remember(self, sid: int, state: State) -> None:
        """``sid`` ended by the shim (ANSWERED) or on both sides (CLOSED)."""
        self.closed[sid] = state
        if len(self.closed) > CLOSED_LOCAL_MEMORY:
            old = next(iter(self.closed))
            del self.closed[old]
            self.drop_runtime.discard(old)
