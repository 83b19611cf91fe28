"""The runtime's header blocks on a stream the shim answers (shim/relay/carried.py), frame by frame.

The client's HPACK decoder mirrors the runtime's encoder: a runtime block that changed that
table reaches the client after the shim's answer on its stream, in the runtime's order; a
block that changed nothing is dropped; the answer it waits for is never stopped by it, and
one that does not end within server.stream_stall_seconds is reset.
"""

from __future__ import annotations

from hpack import Decoder as Reference
from hpack import Encoder
from hypothesis import given
from hypothesis import strategies as st

from shim.relay import http2
from shim.relay.core import RelayCore
from shim.relay.events import Cancelled, Request
from shim.relay.hpack_decoder import changes_table
from tests.unit.test_relay_core import PULL, ROUTE, VERSION, Frame, limits, message, parse

STALL = 30.0
REFUND_777 = (777).to_bytes(4, "big")  # the runtime's WINDOW_UPDATE, as the client gets it
TRAILERS = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12"),
            ("grpc-message", "unknown method")]


class Wire:
    """A RelayCore past both prefaces, with a client and a runtime that keep real HPACK tables."""

    def __init__(self) -> None:
        self.now = 0.0
        self.core = RelayCore(limits(stream_stall_seconds=STALL), ROUTE, clock=lambda: self.now)
        self.core.receive_client(http2.PREFACE)
        self.core.start_relay()
        self.core.receive_runtime(http2.settings_frame({}))
        self.client_enc, self.runtime_enc, self.client_dec = Encoder(), Encoder(), Reference()
        self.client_frames: list[Frame] = []
        self.take()

    def request(self, sid: int, path: str) -> Request:
        block = self.client_enc.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                        (":authority", "x"), ("content-type", "application/grpc")])
        self.core.receive_client(http2.frame(http2.HEADERS, http2.END_HEADERS, sid, block)
                                 + http2.frame(http2.DATA, http2.END_STREAM, sid, message(b"")))
        events = [e for e in self.core.take_events() if isinstance(e, Request)]
        return events[0] if events else None  # type: ignore[return-value]

    def runtime_headers(self, sid: int, headers: list[tuple[str, str]], end: bool = True) -> None:
        flags = http2.END_HEADERS | (http2.END_STREAM if end else 0)
        self.core.receive_runtime(http2.frame(http2.HEADERS, flags, sid, self.runtime_enc.encode(headers)))

    def take(self) -> list[Frame]:
        """What reached the client since the last call (but the shim's refunds of request DATA);
        every header block decoded in order."""
        got = [f for f in parse(self.core.take_client()) if f[0] != http2.WINDOW_UPDATE or f[3] == REFUND_777]
        self.client_frames += got
        for t, f, _, p in got:
            if t == http2.HEADERS:
                self.client_dec.decode(http2.header_block_fragment(t, f, p))
        return got


def on(frames: list[Frame], sid: int) -> list[tuple[int, int]]:
    return [(t, f & http2.END_STREAM) for t, f, s, _ in frames if s == sid and t != http2.WINDOW_UPDATE]


def test_a_block_that_changed_the_table_follows_the_shims_answer_and_holds_what_comes_after() -> None:
    w = Wire()
    s = w.request(1, PULL).stream  # intercepted; its block inserted: the runtime got it, then CANCEL
    w.runtime_headers(1, TRAILERS)  # grpc-go answered before it read the CANCEL
    w.core.receive_runtime(http2.rst_stream(1, http2.NO_ERROR) + http2.window_update(0, 777))
    assert w.take() == []  # behind the shim's answer, which has not ended
    w.core.calls.send_headers(s)
    assert w.core.calls.send_room(s) > 0  # the block never stops the answer it waits for
    w.core.calls.send_data(s, message(b"ok"))
    w.core.calls.send_trailers(s, [(b"grpc-status", b"0")])
    got = w.take()
    assert on(got, 1) == [(http2.HEADERS, 0), (http2.DATA, 0), (http2.HEADERS, 1), (http2.HEADERS, 1)]
    assert got[-1][0] == http2.WINDOW_UPDATE  # the runtime's frames in the runtime's order, after the block
    # the client's table is the runtime's: a relayed answer that indexes the same fields decodes right
    w.request(3, VERSION)
    w.runtime_headers(3, TRAILERS)
    assert w.client_dec.decode(w.take()[-1][3]) == TRAILERS


def test_a_block_that_changed_nothing_is_dropped() -> None:
    w = Wire()
    w.runtime_enc.encode(TRAILERS)  # the runtime's table has these already (an earlier call on the connection)
    w.client_dec.decode(w.runtime_enc.encode([]) or b"")
    s = w.request(1, PULL).stream
    block = http2.encode_headers([(k.encode(), v.encode()) for k, v in TRAILERS])  # literal, never indexed
    w.core.receive_runtime(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, block))
    w.core.calls.send_trailers(s, [(b"grpc-status", b"0")])
    assert on(w.take(), 1) == [(http2.HEADERS, 1)]  # the shim's answer only


def test_an_answer_that_does_not_end_within_the_stall_time_is_reset_and_the_block_goes() -> None:
    w = Wire()
    s = w.request(1, PULL).stream
    w.runtime_headers(1, TRAILERS)
    w.request(3, VERSION)
    w.runtime_headers(3, [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0")])
    assert w.take() == []  # the relayed answer waits behind the block, which waits for the shim's answer
    assert w.core.carrying
    assert w.core.expire_carried(STALL) == ("", STALL)
    w.now += STALL
    assert w.core.expire_carried(STALL) == (PULL, None)
    assert Cancelled(1) in w.core.take_events()  # its handler is cancelled
    got = w.take()
    assert [(t, s_) for t, _, s_, _ in got] == [(http2.RST_STREAM, 1), (http2.HEADERS, 1), (http2.HEADERS, 3)]
    assert not w.core.carrying and s.done


def test_the_clients_reset_of_the_answer_lets_the_block_go() -> None:
    w = Wire()
    w.request(1, PULL)
    w.runtime_headers(1, TRAILERS)
    assert w.take() == []
    w.core.receive_client(http2.rst_stream(1, http2.CANCEL))
    assert [(t, s) for t, _, s, _ in w.take()] == [(http2.HEADERS, 1)]


def test_a_second_answer_waits_behind_the_first_ones_block_and_goes_on_after_it() -> None:
    w = Wire()
    first = w.request(1, PULL).stream
    second = w.request(3, PULL).stream
    w.runtime_headers(1, TRAILERS)
    w.core.calls.send_headers(second)
    assert w.core.calls.send_room(second) == 0  # behind the runtime's frames held in order
    w.core.calls.send_trailers(first, [(b"grpc-status", b"0")])
    assert w.core.calls.send_room(second) > 0
    assert on(w.take(), 1) == [(http2.HEADERS, 1), (http2.HEADERS, 1)]


header_lists = st.lists(st.tuples(st.sampled_from(["grpc-status", "grpc-message", "content-type", ":status", "x-a"]),
                                  st.text("abc0123456789 ", max_size=40)), max_size=6)


@given(st.lists(st.tuples(header_lists, st.sampled_from([None, 0, 64, 4096]), st.booleans()), max_size=8))
def test_changes_table_is_true_whenever_decoding_the_block_changes_the_table(blocks) -> None:
    """Against hpack's own encoder and decoder: never False for a block that changed the table
    (then the client's table would go out of step), and False for blocks of indexed and
    never-indexed fields only."""
    enc, dec = Encoder(), Reference()
    for headers, size, sensitive in blocks:
        if size is not None:
            enc.header_table_size = size
        block = enc.encode([(n, v, sensitive) for n, v in headers])
        before = (dec.header_table.maxsize, list(dec.header_table.dynamic_entries))
        dec.decode(block)
        changed = before != (dec.header_table.maxsize, list(dec.header_table.dynamic_entries))
        if changed:
            assert changes_table(block)
        if sensitive and size is None:  # indexed or never-indexed fields only
            assert not changes_table(block)
