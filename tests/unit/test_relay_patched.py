"""Patched streams (shim/relay/patched.py) on the sans-IO core: ImageStatus/ListImages relayed,
only their response messages rewritten (issue 47 item 3).

What the client must notice: each response message rewritten, everything else of the
runtime's (header blocks, other streams, their order) byte for byte; the client's windows
respected (connection, stream, largest frame); no deadlock for a message larger than the
client's windows; the runtime refunded exactly what the shim consumed; resets both ways;
the bound (server.max_message_bytes). A state machine drives random sizes, splits, windows
and refunds (``PatchedMachine``).
"""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim.cri.methods import IMAGE_STATUS, LIST_IMAGES
from shim.cri.routing import Patch, Router
from shim.relay import http2
from shim.relay.core import RelayCore
from shim.relay.events import PrefaceReceived
from shim.relay.memory import Pool
from tests.unit.test_relay_core import VERSION, Frame, data, grpc_status, headers, limits, message, parse, rst


def mark(body: bytes) -> bytes:
    """A rewrite that changes the size (as marking pins does: it appends a field)."""
    return body + b"\x78\x01"


ROUTE = Router({IMAGE_STATUS: Patch(IMAGE_STATUS, "handler", mark),
                LIST_IMAGES: Patch(LIST_IMAGES, "handler", mark)}).route
RESPONSE_HEADERS = http2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
TRAILERS = http2.encode_headers([(b"grpc-status", b"0")])


class Wire:
    """A RelayCore between a client and a runtime, past both prefaces."""

    def __init__(self, client_settings: dict[int, int] | None = None, **server: object) -> None:
        self.now = 0.0
        self.core = RelayCore(limits(**server), ROUTE, clock=lambda: self.now)
        self.core.receive_client(http2.PREFACE + http2.settings_frame(client_settings or {}))
        assert self.core.take_events() == [PrefaceReceived()]
        self.core.start_relay()
        self.core.receive_runtime(http2.settings_frame({}) + http2.frame(http2.SETTINGS, http2.ACK, 0))
        self.client: list[Frame] = []
        self.runtime: list[Frame] = []
        self.take()

    def take(self) -> tuple[list[Frame], list[Frame]]:
        c, r = parse(self.core.take_client()), parse(self.core.take_runtime())
        self.client += c
        self.runtime += r
        return c, r

    def call(self, sid: int, path: str = IMAGE_STATUS) -> None:
        self.core.receive_client(headers(sid, path) + data(sid, message(b"req"), end_stream=True))

    def answer_headers(self, sid: int) -> bytes:
        return http2.headers_frames(sid, RESPONSE_HEADERS, False, http2.DEFAULT_MAX_FRAME)

    def trailers(self, sid: int) -> bytes:
        return http2.headers_frames(sid, TRAILERS, True, http2.DEFAULT_MAX_FRAME)


def body_of(frames: list[Frame], sid: int) -> bytes:
    return b"".join(p for t, _, s, p in frames if t == http2.DATA and s == sid)


def updates(frames: list[Frame], sid: int) -> int:
    return sum(int.from_bytes(p, "big") for t, _, s, p in frames if t == http2.WINDOW_UPDATE and s == sid)


def test_the_client_gets_the_message_rewritten_and_every_header_block_as_the_runtime_sent_it() -> None:
    w = Wire()
    w.call(1)
    w.call(3, VERSION)
    _, runtime = w.take()
    assert [s for t, _, s, _ in runtime if t == http2.HEADERS] == [1, 3]  # the request, unchanged
    body = b"\x0a\x03img"
    sent = (w.answer_headers(1) + w.answer_headers(3) + data(1, message(body)) + data(3, message(b"v"))
            + w.trailers(1) + w.trailers(3))
    w.core.receive_runtime(sent)
    client, runtime = w.take()
    assert body_of(client, 1) == message(mark(body))
    assert body_of(client, 3) == message(b"v")  # a relayed stream: as it is
    runtime_frames = parse(sent)
    # the runtime's header blocks and the other stream's frames, byte for byte and in order
    assert [f for f in client if not (f[0] == http2.DATA and f[2] == 1)] == \
        [f for f in runtime_frames if not (f[0] == http2.DATA and f[2] == 1)]
    # the rewritten DATA comes where the runtime's was: after its HEADERS, before its trailers
    order = [(t, s) for t, _, s, _ in client]
    assert order.index((http2.DATA, 1)) == 2 and order.index((http2.HEADERS, 1)) == 0
    # the runtime got its window back for the DATA the shim consumed, connection and stream
    assert updates(runtime, 0) == len(message(body)) and updates(runtime, 1) == len(message(body))


def test_a_message_over_many_frames_and_prefixes_split_across_frames() -> None:
    w = Wire()
    w.call(1, LIST_IMAGES)
    w.take()
    bodies = [b"a" * 100, b"", b"b" * 7]
    stream = b"".join(message(b) for b in bodies)
    w.core.receive_runtime(w.answer_headers(1))
    for i in range(0, len(stream), 3):  # prefixes split, several messages per frame
        w.core.receive_runtime(data(1, stream[i:i + 3]))
    w.core.receive_runtime(w.trailers(1))
    client, runtime = w.take()
    assert body_of(client, 1) == b"".join(message(mark(b)) for b in bodies)
    assert [t for t, _, s, _ in client if s == 1][-1] == http2.HEADERS  # trailers last
    assert updates(runtime, 0) == len(stream)


def test_a_compressed_message_passes_unchanged() -> None:
    w = Wire()
    w.call(1)
    w.take()
    compressed = b"\x01" + (3).to_bytes(4, "big") + b"zip"
    w.core.receive_runtime(w.answer_headers(1) + data(1, compressed) + w.trailers(1))
    client, _ = w.take()
    assert body_of(client, 1) == compressed


def test_a_message_larger_than_the_clients_windows_completes_within_them() -> None:
    """The client's stream window is 1,000 bytes, its connection window 65,535, frames 16 KiB;
    the answer is 200 KB: the runtime is refunded at once, so it sends the whole message; the
    client gets it as its windows open, never more than they allow, and the trailers after."""
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 1000})
    w.call(1)
    _, runtime = w.take()
    body = bytes(range(256)) * 800
    stream = message(body)
    runtime_window, sent = http2.DEFAULT_WINDOW, 0
    w.core.receive_runtime(w.answer_headers(1))
    # the runtime's view of stream 1: the client's 1,000, raised by the shim to 64 KiB, after its HEADERS
    kinds = [t for t, _, s, _ in runtime if s == 1]
    assert kinds[0] == http2.HEADERS and http2.WINDOW_UPDATE in kinds[1:]
    stream_window = 1000 + updates(runtime, 1)
    assert stream_window == http2.DEFAULT_WINDOW
    window = {"conn": http2.DEFAULT_WINDOW, "stream": 1000}
    got: list[Frame] = []

    def client_takes() -> list[Frame]:
        client, runtime = w.take()
        for t, _, _, p in client:
            if t == http2.DATA:
                assert len(p) <= window["conn"] and len(p) <= window["stream"] and len(p) <= 16384
                window["conn"] -= len(p)
                window["stream"] -= len(p)
        got.extend(client)
        return runtime

    while sent < len(stream):
        n = min(16384, runtime_window, stream_window, len(stream) - sent)
        assert n > 0, "the runtime has no window left: deadlock"
        w.core.receive_runtime(data(1, stream[sent:sent + n]))
        sent += n
        runtime_window -= n
        stream_window -= n
        runtime = client_takes()
        runtime_window += updates(runtime, 0)
        stream_window += updates(runtime, 1)
    assert sent == len(stream) and runtime_window == http2.DEFAULT_WINDOW  # every consumed byte refunded
    w.core.receive_runtime(w.trailers(1))
    for _ in range(1000):
        if any(t == http2.HEADERS and f & http2.END_STREAM for t, f, _, _ in got):
            break
        w.core.receive_client(http2.window_update(0, 700) + http2.window_update(1, 900))
        window["conn"] += 700
        window["stream"] += 900
        runtime = client_takes()
        assert updates(runtime, 0) == 0 and updates(runtime, 1) == 0  # the client's refunds are the shim's
    assert body_of(got, 1) == message(mark(body))
    assert got[-1][0] == http2.HEADERS and got[-1][1] & http2.END_STREAM


def test_a_relayed_streams_frames_wait_behind_held_rewritten_data_in_order() -> None:
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 10})
    w.call(1)
    w.call(3, VERSION)
    w.take()
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x" * 50)) + w.answer_headers(3)
                           + data(3, message(b"v")) + w.trailers(3) + w.trailers(1))
    client, _ = w.take()
    assert [(t, s) for t, _, s, _ in client] == [(http2.HEADERS, 1), (http2.DATA, 1)]
    assert len(body_of(client, 1)) == 10
    w.core.receive_client(http2.window_update(1, 1000))
    client, runtime = w.take()
    assert [(t, s) for t, _, s, _ in client] == [(http2.DATA, 1), (http2.HEADERS, 3), (http2.DATA, 3),
                                                 (http2.HEADERS, 3), (http2.HEADERS, 1)]
    assert body_of(w.client, 1) == message(mark(b"x" * 50))
    assert updates(runtime, 1) == 0  # the client's stream refund is the shim's


def test_the_clients_reset_reaches_the_runtime_and_drops_what_was_held() -> None:
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
    w.call(1)
    w.take()
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x" * 50)))
    w.core.receive_client(http2.rst_stream(1, http2.CANCEL))
    client, runtime = w.take()
    assert rst(runtime, 1) == http2.CANCEL
    assert body_of(client, 1) == b""
    # late DATA from the runtime is consumed and refunded; its trailers still pass (HPACK)
    w.core.receive_runtime(data(1, message(b"late")) + w.trailers(1))
    client, runtime = w.take()
    assert body_of(client, 1) == b"" and [t for t, _, _, _ in client] == [http2.HEADERS]
    assert updates(runtime, 0) == len(message(b"late"))
    w.call(3, VERSION)  # the connection goes on
    assert [s for t, _, s, _ in w.take()[1] if t == http2.HEADERS] == [3]


def test_the_runtimes_reset_reaches_the_client_without_what_was_held_for_it() -> None:
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
    w.call(1)
    w.take()
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x" * 50)) + http2.rst_stream(1, http2.INTERNAL_ERROR))
    client, _ = w.take()
    # the rewritten message was held behind the stream window: dropped, the reset goes on
    assert [t for t, _, _, _ in client] == [http2.HEADERS, http2.RST_STREAM]
    assert rst(client, 1) == http2.INTERNAL_ERROR and body_of(client, 1) == b""


def test_a_message_over_the_bound_ends_the_call_resource_exhausted() -> None:
    w = Wire(max_message_bytes=4 << 20)
    w.call(1)
    w.take()
    w.core.receive_runtime(w.answer_headers(1) + data(1, b"\x00" + (5 << 20).to_bytes(4, "big") + b"x" * 100))
    client, runtime = w.take()
    assert rst(runtime, 1) == http2.CANCEL and updates(runtime, 0) == 105
    code, text = grpc_status(client[1:], 1) or (None, "")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "server.max_message_bytes" in text
    assert client[-1][1] & http2.END_STREAM
    # what the runtime still sends: DATA consumed (refunded), its RST_STREAM not the client's
    w.core.receive_runtime(data(1, b"y" * 1000) + http2.rst_stream(1, http2.CANCEL))
    client, runtime = w.take()
    assert client == [] and updates(runtime, 0) == 1000


def test_an_answer_the_clients_windows_hold_for_the_stall_time_ends_both_ways() -> None:
    """server.stream_stall_seconds, as for an intercepted answer: the client opens no window for
    it; the call ends with RST_STREAM CANCEL to both, and what waited behind it goes on."""
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
    w.call(1, LIST_IMAGES)
    w.call(3, VERSION)
    w.take()
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x" * 50)) + w.trailers(1) + w.answer_headers(3))
    assert [t for t, _, _, _ in w.take()[0]] == [http2.HEADERS]
    assert w.core.expire_patched(30.0) == ("", 30.0)  # waiting since now
    w.now = 29.0
    assert w.core.expire_patched(30.0) == ("", 30.0)
    w.now = 30.0
    method, when = w.core.expire_patched(30.0)
    assert method == LIST_IMAGES and when is None
    client, runtime = w.take()
    assert body_of(client, 1) == b"" and rst(client, 1) == http2.CANCEL
    # the reset first: the client's call ends CANCELLED; the runtime's trailers after it keep HPACK in step
    assert [(t, s) for t, _, s, _ in client] == [(http2.RST_STREAM, 1), (http2.HEADERS, 1), (http2.HEADERS, 3)]
    assert rst(runtime, 1) is None  # the runtime had ended it (its trailers): nothing to cancel there


def test_a_rewrite_that_fails_passes_the_answer_as_the_runtime_sent_it() -> None:
    def broken(body: bytes) -> bytes:
        raise ValueError("a bug")

    core = RelayCore(limits(), Router({IMAGE_STATUS: Patch(IMAGE_STATUS, "handler", broken)}).route)
    core.receive_client(http2.PREFACE + http2.settings_frame({}))
    core.start_relay()
    core.receive_runtime(http2.settings_frame({}))
    core.receive_client(headers(1, IMAGE_STATUS) + data(1, message(b"req"), end_stream=True))
    core.take_client()
    core.receive_runtime(http2.headers_frames(1, RESPONSE_HEADERS, False, http2.DEFAULT_MAX_FRAME)
                         + data(1, message(b"\x0a\x03img"))
                         + http2.headers_frames(1, TRAILERS, True, http2.DEFAULT_MAX_FRAME))
    client = parse(core.take_client())
    assert body_of(client, 1) == message(b"\x0a\x03img")
    assert client[-1][0] == http2.HEADERS and client[-1][1] & http2.END_STREAM


def test_patched_answers_count_in_max_intercepted_calls_until_they_end() -> None:
    """A patched answer is held in the shim (buffered, rewritten, waiting for windows): it counts
    as an intercepted call, so a client cannot make the shim hold more of them than the key allows."""
    calls = Pool(2)
    w = Wire(calls=calls)
    w.call(1)
    w.call(3, LIST_IMAGES)
    w.call(5)
    client, runtime = w.take()
    code, text = grpc_status(client, 5) or (None, "")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "server.max_intercepted_calls" in text
    assert not body_of(runtime, 5)  # its request never reaches the runtime
    assert calls.used == 2
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x")) + w.trailers(1))
    client, _ = w.take()
    assert body_of(client, 1) == message(mark(b"x")) and calls.used == 1  # answered: free again
    w.call(7)
    assert calls.used == 2
    w.core.receive_client(http2.rst_stream(3, http2.CANCEL))  # the client gives up on one: free at once
    assert calls.used == 1  # (a runtime sends nothing more after a RST_STREAM: no need to wait for it)
    w.core.receive_runtime(w.answer_headers(3) + data(3, message(b"late")) + http2.rst_stream(3, http2.CANCEL))
    assert calls.used == 1
    w.core.patching.lost()  # the connection is gone: nothing is held
    assert calls.used == 0


def test_a_patched_call_the_client_resets_is_free_though_the_runtime_sends_nothing_more() -> None:
    """Regression (found by test_relay_trust_machine.py): a conforming runtime sends nothing after
    the client's RST_STREAM, so a reset patched call counted in server.max_intercepted_calls until
    the connection closed; kubelet giving up on ImageStatus calls ran out of calls."""
    calls = Pool(4)
    w = Wire(calls=calls)
    for sid in (1, 3, 5):
        w.call(sid)
        w.core.receive_client(http2.rst_stream(sid, http2.CANCEL))
    _, runtime = w.take()
    assert [rst(runtime, sid) for sid in (1, 3, 5)] == [http2.CANCEL] * 3
    assert calls.used == 0
    for sid in (7, 9, 11, 13):  # all of the pool is there for new calls
        w.call(sid)
    assert grpc_status(w.take()[0], 13) is None and calls.used == 4


def test_an_answer_ended_for_stalling_after_the_runtime_ended_it_is_free() -> None:
    """Regression (found by test_relay_trust_machine.py): the runtime had sent the whole answer
    (trailers included), the client's window held it for server.stream_stall_seconds; the call
    ended both ways but kept its count in server.max_intercepted_calls for the connection's life."""
    calls = Pool(4)
    w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: 0}, calls=calls)
    w.call(1)
    w.core.receive_runtime(w.answer_headers(1) + data(1, message(b"x" * 50)) + w.trailers(1))
    assert w.core.expire_patched(30.0) == ("", 30.0)
    w.now = 30.0
    assert w.core.expire_patched(30.0)[0] == IMAGE_STATUS
    client, _ = w.take()
    assert rst(client, 1) == http2.CANCEL and calls.used == 0


def test_the_runtime_lost_answers_a_patched_call_unavailable() -> None:
    w = Wire()
    w.call(1)
    w.take()
    w.core.receive_runtime(w.answer_headers(1))
    w.take()
    assert w.core.runtime_lost()  # no intercepted call to finish: the connection closes
    client, _ = w.take()
    assert any(t == http2.GOAWAY for t, _, _, _ in client)


# ------------------------------------------------------------------ state machine


class PatchedMachine(RuleBasedStateMachine):
    """Random answers, splits, client windows and refunds; a plain relayed stream beside them.

    The runtime is conforming (sends DATA within the windows it knows); the client refunds what
    it got, at random times and in random amounts, sometimes more (window growth), changes its
    initial stream window, and resets a patched call now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.w: Wire | None = None

    @rule(initial=st.integers(0, 70_000), max_frame=st.integers(16384, 40_000), conn_extra=st.integers(0, 100_000),
          sizes=st.lists(st.integers(0, 150_000), min_size=1, max_size=3), relayed=st.integers(0, 30_000))
    @precondition(lambda self: self.w is None)
    def start(self, initial: int, max_frame: int, conn_extra: int, sizes: list[int], relayed: int) -> None:
        self.initial, self.max_frame = initial, max_frame
        self.w = w = Wire({http2.SETTINGS_INITIAL_WINDOW_SIZE: initial, http2.SETTINGS_MAX_FRAME_SIZE: max_frame})
        if conn_extra:
            w.core.receive_client(http2.window_update(0, conn_extra))
        self.client_conn = http2.DEFAULT_WINDOW + conn_extra  # the client's window toward it
        self.runtime_conn = http2.DEFAULT_WINDOW  # what the runtime may send, as it knows it
        self.owed = 0  # the shim's own bytes the client has not refunded yet (its refunds repay them first)
        self.pending: dict[int, bytes] = {}  # what the runtime still has to send, per stream
        self.expected: dict[int, bytes] = {}
        self.client_stream: dict[int, int] = {}
        self.runtime_stream: dict[int, int] = {}
        self.unrefunded_conn = 0
        self.unrefunded: dict[int, int] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self.patched: set[int] = set()
        self.seen: dict[int, list[tuple[int, int]]] = {}
        sid = 1
        for size in sizes:
            body = bytes((i * 7 + sid) & 0xFF for i in range(size))
            self._open(sid, IMAGE_STATUS, message(body), message(mark(body)))
            self.patched.add(sid)
            sid += 2
        self._open(sid, VERSION, message(b"r" * relayed), message(b"r" * relayed))
        self._deliver()

    def _open(self, sid: int, path: str, wire_body: bytes, expected: bytes) -> None:
        assert self.w is not None
        self.w.call(sid, path)
        self.pending[sid] = wire_body
        self.expected[sid] = expected
        self.client_stream[sid] = self.initial
        self.runtime_stream[sid] = self.initial
        self.unrefunded[sid] = 0
        self.seen[sid] = []
        self.w.core.receive_runtime(self.w.answer_headers(sid))

    def _deliver(self) -> None:
        """Take what both sides got, checking the client's windows frame by frame."""
        assert self.w is not None
        client, runtime = self.w.take()
        for t, f, s, p in client:
            if s:
                self.seen[s].append((t, f))
            if t == http2.DATA:
                n = len(p)
                assert n <= self.max_frame
                assert n <= self.client_conn, "over the client's connection window"
                assert n <= self.client_stream[s], "over the client's stream window"
                assert s not in self.ended, "DATA after the trailers"
                assert s not in self.reset, "DATA after the client's reset"
                self.client_conn -= n
                self.client_stream[s] -= n
                self.unrefunded_conn += n
                self.unrefunded[s] += n
                if s in self.patched:
                    self.owed += n
            if t == http2.HEADERS and f & http2.END_STREAM:
                self.ended.add(s)
            assert t != http2.GOAWAY and (t != http2.RST_STREAM or s in self.reset)
        for t, _, s, p in runtime:
            if t == http2.WINDOW_UPDATE:
                inc = int.from_bytes(p, "big")
                if s == 0:
                    self.runtime_conn += inc
                elif s in self.runtime_stream:
                    self.runtime_stream[s] += inc

    @rule(data=st.data())
    @precondition(lambda self: self.w is not None)
    def runtime_sends(self, data: st.DataObject) -> None:
        assert self.w is not None
        open_ = [s for s, rest in self.pending.items() if rest]
        if not open_:
            return
        sid = data.draw(st.sampled_from(open_))
        room = min(self.runtime_conn, self.runtime_stream[sid], self.max_frame, len(self.pending[sid]))
        if room <= 0:
            return
        n = data.draw(st.integers(1, room))
        chunk, self.pending[sid] = self.pending[sid][:n], self.pending[sid][n:]
        self.runtime_conn -= n
        self.runtime_stream[sid] -= n
        out = data_frame = http2.frame(http2.DATA, 0, sid, chunk)
        if not self.pending[sid]:
            out = data_frame + self.w.trailers(sid)
        self.w.core.receive_runtime(out)
        self._deliver()

    @rule(data=st.data())
    @precondition(lambda self: self.w is not None)
    def client_refunds(self, data: st.DataObject) -> None:
        assert self.w is not None
        out = b""
        conn = data.draw(st.integers(0, self.unrefunded_conn + 1000))
        if conn:
            out += http2.window_update(0, conn)
            self.unrefunded_conn = max(0, self.unrefunded_conn - conn)
            self.client_conn += conn
            self.owed -= min(conn, self.owed)
        for sid in sorted(self.unrefunded):
            if sid in self.ended or sid in self.reset:
                continue
            inc = data.draw(st.integers(0, self.unrefunded[sid] + 500))
            if inc:
                out += http2.window_update(sid, inc)
                self.unrefunded[sid] = max(0, self.unrefunded[sid] - inc)
                self.client_stream[sid] += inc
        self.w.core.receive_client(out)
        self._deliver()

    @rule(data=st.data())
    @precondition(lambda self: self.w is not None)
    def client_resets(self, data: st.DataObject) -> None:
        assert self.w is not None
        open_ = sorted(s for s in self.patched if s not in self.ended and s not in self.reset)
        if not open_:
            return
        sid = data.draw(st.sampled_from(open_))
        self.w.core.receive_client(http2.rst_stream(sid, http2.CANCEL))
        self.reset.add(sid)
        self._deliver()
        assert rst(self.w.runtime, sid) == http2.CANCEL  # relayed to the runtime
        late = self.pending[sid][:data.draw(st.integers(0, min(len(self.pending[sid]), self.runtime_conn,
                                                              self.runtime_stream[sid], self.max_frame)))]
        self.pending[sid] = b""  # the runtime stops, after what it had sent already
        if late:
            self.runtime_conn -= len(late)
            self.w.core.receive_runtime(http2.frame(http2.DATA, 0, sid, late))
            self._deliver()

    @rule(new=st.integers(0, 100_000))
    @precondition(lambda self: self.w is not None)
    def client_changes_its_initial_window(self, new: int) -> None:
        assert self.w is not None
        delta = new - self.initial
        self.initial = new
        self.w.core.receive_client(http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: new}))
        for sid in self.client_stream:  # both peers apply it to every stream (RFC 9113 6.9.2)
            self.client_stream[sid] += delta
            self.runtime_stream[sid] += delta
        self.w.core.receive_runtime(http2.frame(http2.SETTINGS, http2.ACK, 0))  # the runtime acknowledges it
        self._deliver()

    @invariant()
    def every_patched_answer_still_held_counts_once_in_max_intercepted_calls(self) -> None:
        """Until it is sent, or its stream was reset and nothing of it waits any more."""
        if self.w is not None:
            held = [s for s in self.w.core.patching.streams.values() if not s.discard or s.pending]
            assert self.w.core.limits.calls.used == len(held)

    @invariant()
    def the_runtime_never_gets_more_window_than_the_client_allows(self) -> None:
        if self.w is None:
            return
        # the shim refunds the runtime at once for what it consumes, so the runtime's view may be
        # ahead of the client's real window by the shim's own bytes the client has not refunded yet
        assert self.runtime_conn <= self.client_conn + self.owed
        for sid, view in self.runtime_stream.items():
            if sid not in self.patched:
                assert view <= self.client_stream[sid]
            elif sid not in self.ended and sid not in self.reset:
                # the shim's: what the client's SETTINGS give, raised to at least 64 KiB once
                assert view <= self.initial + http2.DEFAULT_WINDOW

    def teardown(self) -> None:
        """Every stream finishes: the client refunds all it gets, the runtime sends all it has."""
        w = self.w
        if w is None:
            return
        for _ in range(10_000):
            if all(s in self.ended or s in self.reset for s in self.expected):
                break
            for sid, rest in self.pending.items():
                room = min(self.runtime_conn, self.runtime_stream[sid], self.max_frame, len(rest))
                if rest and room > 0:
                    chunk, self.pending[sid] = rest[:room], rest[room:]
                    self.runtime_conn -= room
                    self.runtime_stream[sid] -= room
                    out = http2.frame(http2.DATA, 0, sid, chunk)
                    w.core.receive_runtime(out + (w.trailers(sid) if not self.pending[sid] else b""))
            self._deliver()
            out = http2.window_update(0, self.unrefunded_conn + 1)
            self.client_conn += self.unrefunded_conn + 1
            self.owed -= min(self.unrefunded_conn + 1, self.owed)
            self.unrefunded_conn = 0
            for sid in self.unrefunded:
                if sid not in self.ended and sid not in self.reset:
                    out += http2.window_update(sid, self.unrefunded[sid] + 1)
                    self.client_stream[sid] += self.unrefunded[sid] + 1
                    self.unrefunded[sid] = 0
            w.core.receive_client(out)
            self._deliver()
        assert all(s in self.ended or s in self.reset for s in self.expected), "a stream never finished"
        for sid, want in self.expected.items():
            if sid in self.reset:  # what it got before its reset: the start of the answer
                assert want.startswith(body_of(w.client, sid))
                continue
            assert body_of(w.client, sid) == want
            kinds = self.seen[sid]
            assert kinds[0][0] == http2.HEADERS and kinds[-1][0] == http2.HEADERS and kinds[-1][1] & http2.END_STREAM
            assert all(t == http2.DATA for t, _ in kinds[1:-1])
        # an answered patched stream holds nothing more; the connection's end frees the rest
        assert not [sid for sid in self.patched - self.reset if sid in w.core.patching.streams]
        w.core.patching.lost()
        assert w.core.limits.calls.used == 0


TestPatchedMachine = PatchedMachine.TestCase
TestPatchedMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
