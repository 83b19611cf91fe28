"""Streams at once per connection (issue 25), frame by frame on the sans-IO core.

The shim advertises SETTINGS_MAX_CONCURRENT_STREAMS (server.max_concurrent_streams, or the
runtime's own value if lower) and refuses a new stream beyond it with REFUSED_STREAM, before
the runtime sees it. A relayed stream counts until the runtime's END_STREAM or RST_STREAM
(or the client's RST_STREAM) passes the shim: answers the shim has not read from the runtime
(it stops reading the runtime for a client that does not read) keep their calls counted.
"""

from __future__ import annotations

import grpc
from hpack import Encoder

from shim.relay import http2
from shim.relay.core import REFUSED_STREAMS_BURST, REFUSED_STREAMS_PER_SECOND, RelayCore
from shim.relay.events import Request, StreamRefused
from tests.unit.test_relay_core import (PULL, ROUTE, VERSION, Peers, closed_with, data, goaway_code,
                                        grpc_status, headers, limits, message, parse, rst)


def advertised(frames: list) -> dict[int, int]:
    """The SETTINGS (not ACK) the client got, the last value of each parameter winning."""
    out: dict[int, int] = {}
    for t, f, _, p in frames:
        if t == http2.SETTINGS and not f & http2.ACK:
            out.update((int.from_bytes(p[i:i + 2], "big"), int.from_bytes(p[i + 2:i + 6], "big"))
                       for i in range(0, len(p), 6))
    return out


def new_peers(cap: int, runtime_settings: dict[int, int] | None = None) -> tuple[Peers, dict[int, int]]:
    p = Peers(limits(max_concurrent_streams=cap), relay=True)
    p.from_runtime(http2.settings_frame(runtime_settings or {}))
    return p, advertised(p.client_got())


def version_call(sid: int) -> bytes:
    return headers(sid, VERSION) + data(sid, message(b""), end_stream=True)


def opened(frames: list) -> list[int]:
    return [s for t, _, s, _ in frames if t == http2.HEADERS]


def answer(sid: int) -> bytes:
    """The runtime's whole answer to a call: headers, a message, trailers with END_STREAM."""
    return (http2.headers_frames(sid, http2.encode_headers([(b":status", b"200")]), False, http2.DEFAULT_MAX_FRAME)
            + data(sid, message(b"v"))
            + http2.headers_frames(sid, http2.encode_headers([(b"grpc-status", b"0")]), True, http2.DEFAULT_MAX_FRAME))


def test_the_client_is_told_the_limit_and_a_lower_one_of_the_runtime_wins() -> None:
    _, ours = new_peers(3)
    assert ours[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == 3
    p, theirs = new_peers(3, {http2.SETTINGS_MAX_CONCURRENT_STREAMS: 2})
    assert theirs[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == 2
    p.from_client(version_call(1) + version_call(3) + version_call(5))
    assert opened(p.runtime_got()) == [1, 3]
    assert rst(p.client_got(), 5) == http2.REFUSED_STREAM
    # a later SETTINGS without the parameter leaves it in force (RFC 9113 6.5.2)
    p.from_runtime(http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20}))
    assert advertised(p.client_got())[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == 2
    p.from_client(version_call(7))
    assert rst(p.client_got(), 7) == http2.REFUSED_STREAM
    # a higher runtime value never raises the shim's own
    p.from_runtime(http2.settings_frame({http2.SETTINGS_MAX_CONCURRENT_STREAMS: 1000}))
    assert advertised(p.client_got())[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == 3


def test_a_stream_beyond_the_limit_is_refused_and_never_reaches_the_runtime() -> None:
    p, _ = new_peers(2)
    p.from_client(version_call(1) + version_call(3) + version_call(5))
    runtime = p.runtime_got()
    assert opened(runtime) == [1, 3]
    assert all(s != 5 for _, _, s, _ in runtime)  # neither its HEADERS nor its DATA
    client = p.client_got()
    assert rst(client, 5) == http2.REFUSED_STREAM
    assert p.events() == [StreamRefused(2)]
    # its DATA is consumed: the connection window the client spent on it comes back
    assert (http2.WINDOW_UPDATE, 0, 0, len(message(b"")).to_bytes(4, "big")) in client


def test_calls_whose_answers_the_shim_has_not_read_stay_counted_until_the_answer_passes() -> None:
    """The adapter stops reading the runtime for a client that does not read: the runtime's
    END_STREAM has not passed the shim, so those calls keep their place and nothing more is
    relayed; once an answer passes (the client drained), a new call goes through."""
    p, _ = new_peers(2)
    p.from_client(version_call(1) + version_call(3))
    assert opened(p.runtime_got()) == [1, 3]
    p.from_runtime(http2.headers_frames(1, http2.encode_headers([(b":status", b"200")]), False, http2.DEFAULT_MAX_FRAME))
    p.from_client(version_call(5))  # response headers alone do not end the call
    assert rst(p.client_got(), 5) == http2.REFUSED_STREAM and opened(p.runtime_got()) == []
    p.from_runtime(data(1, message(b"v")) + http2.headers_frames(1, http2.encode_headers([(b"grpc-status", b"0")]), True,
                                                               http2.DEFAULT_MAX_FRAME))
    assert rst(p.client_got(), 1) is None  # stream 1's answer went to the client whole
    p.from_client(version_call(7))
    assert opened(p.runtime_got()) == [7]


def test_the_clients_reset_or_the_runtimes_reset_frees_a_place() -> None:
    p, _ = new_peers(2)
    p.from_client(version_call(1) + version_call(3))
    p.runtime_got()
    p.from_client(http2.rst_stream(1, http2.CANCEL) + version_call(5))
    assert opened(p.runtime_got()) == [5]
    p.from_runtime(http2.rst_stream(3, http2.REFUSED_STREAM))  # the runtime's own refusal reaches the client
    assert rst(p.client_got(), 3) == http2.REFUSED_STREAM
    p.from_client(version_call(7) + version_call(9))
    assert opened(p.runtime_got()) == [7]
    assert rst(p.client_got(), 9) == http2.REFUSED_STREAM


def test_intercepted_calls_count_too_and_free_their_place_when_answered() -> None:
    p, _ = new_peers(2)
    p.from_client(headers(1, PULL, end_stream=True) + version_call(3) + headers(5, PULL, end_stream=True))
    ev, refused = p.events()
    assert isinstance(ev, Request) and ev.stream.sid == 1
    assert refused == StreamRefused(2)  # the adapter logs it (rate-limited)
    assert rst(p.client_got(), 5) == http2.REFUSED_STREAM
    assert opened(p.runtime_got()) == [3]
    p.core.calls.answer_error(ev.stream, grpc.StatusCode.NOT_FOUND, "no")
    p.from_client(headers(7, PULL, end_stream=True))
    [ev7] = p.events()
    assert isinstance(ev7, Request) and ev7.stream.sid == 7
    assert grpc_status(p.client_got(), 1) == (grpc.StatusCode.NOT_FOUND.value[0], "no")


def test_a_refused_block_that_changed_the_hpack_table_still_reaches_the_runtime_cancelled() -> None:
    """The runtime's decoder must stay in step: the block goes to it without END_STREAM,
    followed by RST_STREAM CANCEL, and whatever the runtime answers on it is dropped."""
    p, _ = new_peers(1)
    p.from_client(version_call(1))
    p.runtime_got()
    enc = Encoder()  # indexes every field: the block inserts into the dynamic table
    block = enc.encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", VERSION.encode()),
                        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    p.from_client(http2.headers_frames(3, block, True, http2.DEFAULT_MAX_FRAME))
    assert rst(p.client_got(), 3) == http2.REFUSED_STREAM
    runtime = p.runtime_got()
    assert [(t, f & http2.END_STREAM) for t, f, s, _ in runtime if s == 3] == [(http2.HEADERS, 0), (http2.RST_STREAM, 0)]
    assert rst(runtime, 3) == http2.CANCEL
    p.from_runtime(answer(3))
    assert [s for _, _, s, _ in p.client_got()] == []


def test_no_limit_applies_without_a_runtime() -> None:
    p = Peers(limits(max_concurrent_streams=1), relay=False)
    p.from_client(version_call(1) + version_call(3))
    frames = p.client_got()
    assert [grpc_status(frames, s)[0] for s in (1, 3)] == [grpc.StatusCode.UNAVAILABLE.value[0]] * 2
    assert parse(p.core.take_runtime()) == []


def test_a_client_that_keeps_opening_streams_over_the_limit_is_sent_away() -> None:
    """Refusals come in a burst (streams opened before the client got the limit), then at a
    rate; beyond, GOAWAY ENHANCE_YOUR_CALM: each refused stream still costs a header block."""
    now = [0.0]
    p = Peers.__new__(Peers)
    p.core = RelayCore(limits(max_concurrent_streams=1), ROUTE, clock=lambda: now[0])
    p.from_client(http2.PREFACE)
    p.events()
    p.core.start_relay()
    p.from_runtime(http2.settings_frame({}))
    p.client_got()
    p.from_client(version_call(1))  # stays open: the runtime never answers
    sid = 3
    for _ in range(REFUSED_STREAMS_BURST):
        p.from_client(version_call(sid))
        sid += 2
    frames = p.client_got()
    assert goaway_code(frames) is None and rst(frames, sid - 2) == http2.REFUSED_STREAM
    now[0] += 1.0
    for _ in range(int(REFUSED_STREAMS_PER_SECOND)):
        p.from_client(version_call(sid))
        sid += 2
    assert goaway_code(p.client_got()) is None
    assert opened(p.runtime_got()) == [1]
    p.from_client(version_call(sid))
    assert "server.max_concurrent_streams" in closed_with(p, http2.ENHANCE_YOUR_CALM)
