"""The relay's sans-IO core (shim/relay/core.py), frame by frame, without sockets.

Each test plays a client and a runtime against one RelayCore and checks what reaches
each side: the RFC 9113 answers the shim gives itself (as containerd's grpc-go would),
what it must never relay, and the bounds on what a client can make it hold.
"""

from __future__ import annotations

import grpc
import pytest
from hpack import Encoder

from shim.relay import http2
from shim.relay.hpack_decoder import Decoder
from shim.config import ServerConfig
from shim.cri.routing import Router
from shim.relay.core import Phase, RelayCore
from shim.relay.events import Cancelled, ConnectionClosed, PrefaceReceived, Request
from shim.relay.limits import Limits
from shim.relay.memory import Pool
from shim.relay.streams import LocalStream

PULL = "/runtime.v1.ImageService/PullImage"
REMOVE = "/runtime.v1.ImageService/RemoveImage"
VERSION = "/runtime.v1.RuntimeService/Version"
INTERCEPTED = {PULL, REMOVE}
ROUTE = Router(dict.fromkeys(INTERCEPTED, "handler"), ("vendor.*",)).route


def limits(request_buffer: Pool | None = None, calls: Pool | None = None, **server: object) -> Limits:
    """The relay's limits for server.* ``server`` (ServerConfig's defaults otherwise)."""
    return Limits.of(ServerConfig(**server), request_buffer, calls)

Frame = tuple[int, int, int, bytes]


def parse(data: bytes) -> list[Frame]:
    out = []
    if data.startswith(http2.PREFACE):
        data = data[len(http2.PREFACE):]
    while data:
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9:9 + n]))
        data = data[9 + n:]
    return out


def request_block(path: str, **extra: str) -> bytes:
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"x"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    headers += [(k.replace("_", "-").encode(), v.encode()) for k, v in extra.items()]
    return http2.encode_headers(headers)


def headers(sid: int, path: str, end_stream: bool = False) -> bytes:
    return http2.headers_frames(sid, request_block(path), end_stream, http2.DEFAULT_MAX_FRAME)


def data(sid: int, payload: bytes, end_stream: bool = False) -> bytes:
    return http2.frame(http2.DATA, http2.END_STREAM if end_stream else 0, sid, payload)


def message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


class Peers:
    """A RelayCore with a client and a runtime attached, past both prefaces."""

    def __init__(self, lim: Limits | None = None, relay: bool = True, trusted: bool = True) -> None:
        self.core = RelayCore(lim or limits(), ROUTE, trusted=trusted)
        self.core.receive_client(http2.PREFACE)
        assert self.core.take_events() == [PrefaceReceived()]
        assert self.core.take_runtime() == b""  # nothing for the runtime before we know where calls go
        if relay:
            self.core.start_relay()
            assert self.core.take_runtime() == http2.PREFACE
            self.from_runtime(http2.settings_frame({}))
        else:
            self.core.start_local("cri-shim: the container runtime at /x is not reachable")
        self.client_got()

    def from_client(self, raw: bytes) -> None:
        self.core.receive_client(raw)

    def from_runtime(self, raw: bytes) -> None:
        self.core.receive_runtime(raw)

    def client_got(self) -> list[Frame]:
        return parse(self.core.take_client())

    def runtime_got(self) -> list[Frame]:
        return parse(self.core.take_runtime())

    def events(self) -> list:
        return self.core.take_events()


def goaway_code(frames: list[Frame]) -> int | None:
    codes = [int.from_bytes(p[4:8], "big") for t, _, _, p in frames if t == http2.GOAWAY]
    return codes[-1] if codes else None


def rst(frames: list[Frame], sid: int) -> int | None:
    codes = [int.from_bytes(p, "big") for t, _, s, p in frames if t == http2.RST_STREAM and s == sid]
    return codes[-1] if codes else None


def grpc_status(frames: list[Frame], sid: int) -> tuple[int, str] | None:
    for t, _, s, p in frames:
        if t == http2.HEADERS and s == sid:
            hs = dict(Decoder().decode(p, full=True)[1])
            if b"grpc-status" in hs:
                return int(hs[b"grpc-status"]), hs.get(b"grpc-message", b"").decode()
    return None


def closed_with(p: Peers, code: int) -> str:
    """The connection ended with GOAWAY(code); returns the reason."""
    assert goaway_code(p.client_got()) == code
    [ev] = [e for e in p.events() if isinstance(e, ConnectionClosed)]
    assert ev.code == code
    return ev.reason


# ------------------------------------------------------------------ preface


def test_runtime_is_not_involved_before_a_valid_preface() -> None:
    core = RelayCore(limits(), ROUTE)
    core.receive_client(http2.PREFACE[:10])
    assert core.take_events() == [] and core.take_client() == b""
    core.receive_client(http2.PREFACE[10:] + http2.settings_frame({}))
    assert core.take_events() == [PrefaceReceived()]
    assert core.take_runtime() == b""
    core.start_relay()  # what came after the preface goes to the runtime now
    assert [(t, f) for t, f, _, _ in parse(core.take_runtime())] == [(http2.SETTINGS, 0)]


def test_garbage_instead_of_a_preface_closes_without_a_runtime() -> None:
    core = RelayCore(limits(), ROUTE)
    core.receive_client(b"GET / HTTP/1.1\r\n")
    [ev] = core.take_events()
    assert isinstance(ev, ConnectionClosed) and ev.code == http2.PROTOCOL_ERROR
    assert core.take_runtime() == b""


# ------------------------------------------------------------------ frame layer


@pytest.mark.parametrize("bad, code", [
    (http2.frame(http2.SETTINGS, 0, 1, b""), http2.PROTOCOL_ERROR),  # SETTINGS on a stream: not rewritten onto 0
    (http2.frame(http2.SETTINGS, http2.ACK, 0, b"\0" * 6), http2.FRAME_SIZE_ERROR),
    (http2.frame(http2.SETTINGS, 0, 0, b"\0" * 5), http2.FRAME_SIZE_ERROR),
    (http2.settings_frame({http2.SETTINGS_ENABLE_PUSH: 2}), http2.PROTOCOL_ERROR),
    (http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 2**31}), http2.FLOW_CONTROL_ERROR),
    (http2.settings_frame({http2.SETTINGS_MAX_FRAME_SIZE: 100}), http2.PROTOCOL_ERROR),
    (http2.window_update(0, 0), http2.PROTOCOL_ERROR),
    (http2.frame(http2.WINDOW_UPDATE, 0, 0, b"\0\0\0\1\0"), http2.FRAME_SIZE_ERROR),
    (http2.window_update(0, 2**31 - 1), http2.FLOW_CONTROL_ERROR),  # the connection window overflows
    (http2.frame(http2.PING, 0, 0, b"1234567"), http2.FRAME_SIZE_ERROR),
    (http2.frame(http2.PING, 0, 3, b"12345678"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.PRIORITY, 0, 1, b"\0\0\0\0"), http2.FRAME_SIZE_ERROR),
    (http2.frame(http2.PRIORITY, 0, 0, b"\0\0\0\0\0"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.RST_STREAM, 0, 1, b"\0\0\0"), http2.FRAME_SIZE_ERROR),
    (http2.frame(http2.RST_STREAM, 0, 0, b"\0\0\0\0"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.GOAWAY, 0, 1, b"\0" * 8), http2.PROTOCOL_ERROR),
    (http2.frame(http2.DATA, 0, 0, b"x"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.DATA, http2.PADDED, 1, b"\x05abc"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.HEADERS, http2.END_HEADERS, 0, request_block(VERSION)), http2.PROTOCOL_ERROR),
    (http2.frame(http2.HEADERS, http2.END_HEADERS, 2, request_block(VERSION)), http2.PROTOCOL_ERROR),  # even id
    (http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, b""), http2.PROTOCOL_ERROR),
    (http2.frame(http2.PUSH_PROMISE, http2.END_HEADERS, 1, b"\0\0\0\2"), http2.PROTOCOL_ERROR),
    (http2.frame(http2.DATA, 0, 1, b"x" * (http2.DEFAULT_MAX_FRAME + 1)), http2.FRAME_SIZE_ERROR),
])
def test_connection_errors_the_shim_answers_itself(bad: bytes, code: int) -> None:
    p = Peers()
    p.from_client(bad)
    assert closed_with(p, code)
    assert p.runtime_got() == []  # never relayed


@pytest.mark.parametrize("inside", [
    http2.frame(http2.PRIORITY, 0, 1, b"\0\0\0\0\x10"),
    http2.frame(0x42, 0, 0, b"extension"),
    http2.frame(http2.DATA, 0, 1, b"x"),
    http2.frame(http2.HEADERS, http2.END_HEADERS, 3, request_block(VERSION)),
    http2.frame(http2.CONTINUATION, http2.END_HEADERS, 3, b""),  # another stream's CONTINUATION
])
def test_any_other_frame_inside_an_open_header_block_is_a_protocol_error(inside: bytes) -> None:
    p = Peers()
    block = request_block(VERSION)
    p.from_client(http2.frame(http2.HEADERS, 0, 1, block[:5]) + inside + http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1,
                                                                            block[5:]))
    assert closed_with(p, http2.PROTOCOL_ERROR)
    assert p.runtime_got() == []


def test_frame_size_limit_is_what_the_runtime_advertised() -> None:
    p = Peers()
    p.from_runtime(http2.settings_frame({http2.SETTINGS_MAX_FRAME_SIZE: 1 << 20}))
    p.from_client(headers(1, VERSION) + data(1, b"x" * 100_000, end_stream=True))
    assert [t for t, *_ in p.runtime_got()] == [http2.HEADERS, http2.DATA]
    assert goaway_code(p.client_got()) is None


def test_stream_errors_on_relayed_streams_are_left_to_the_runtime() -> None:
    p = Peers()
    p.from_client(headers(1, VERSION) + http2.window_update(1, 0))
    assert [t for t, *_ in p.runtime_got()] == [http2.HEADERS, http2.WINDOW_UPDATE]  # grpc-go resets it
    assert p.client_got() == []


def test_unknown_frames_outside_a_header_block_pass() -> None:
    p = Peers()
    p.from_client(http2.frame(0x42, 0, 0, b"ext"))
    assert p.runtime_got() == [(0x42, 0, 0, b"ext")]


# ------------------------------------------------------------------ header blocks


def test_header_block_over_the_limit_closes_the_connection_before_it_is_all_buffered() -> None:
    p = Peers(limits(max_header_list_bytes=8192))
    p.from_client(http2.frame(http2.HEADERS, 0, 1, request_block(VERSION)))
    for _ in range(3):
        p.from_client(http2.frame(http2.CONTINUATION, 0, 1, b"\0" * 4000))
    reason = closed_with(p, http2.PROTOCOL_ERROR)
    assert "server.max_header_list_bytes" in reason
    assert p.core.block.frames == [] or p.core.phase == Phase.CLOSED
    p.from_client(http2.frame(http2.CONTINUATION, 0, 1, b"\0" * 4000))  # nothing more is read
    assert p.runtime_got() == []


def test_a_single_headers_frame_over_the_limit_closes_the_connection_too() -> None:
    p = Peers(limits(max_header_list_bytes=8192))
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1,
                           request_block(VERSION, x_big="v" * 9000)))
    assert "server.max_header_list_bytes" in closed_with(p, http2.PROTOCOL_ERROR)
    assert p.runtime_got() == []


@pytest.mark.parametrize("flags,prefix,padding", [
    (http2.PADDED, b"\x03", b"\0\0\0"),
    (http2.PRIORITY_FLAG, b"\0\0\0\0\x10", b""),
    (http2.PADDED | http2.PRIORITY_FLAG, b"\x02\0\0\0\0\x10", b"\0\0"),
])
def test_padding_and_priority_in_headers_are_not_part_of_the_header_block(flags: int, prefix: bytes,
                                                                            padding: bytes) -> None:
    """The path is read from the block alone: a refused service is refused, a relayed call goes
    on byte for byte (padding and priority included)."""
    p = Peers()
    flags |= http2.END_HEADERS | http2.END_STREAM
    p.from_client(http2.frame(http2.HEADERS, flags, 1, prefix + request_block("/containerd.services.images.v1.Images/Delete")
                           + padding))
    assert p.runtime_got() == []
    assert grpc_status(p.client_got(), 1)[0] == grpc.StatusCode.PERMISSION_DENIED.value[0]
    relayed = http2.frame(http2.HEADERS, flags, 3, prefix + request_block(VERSION) + padding)
    p.from_client(relayed)
    assert p.core.take_runtime() == relayed


def test_decoded_header_list_over_the_limit_refuses_the_stream_and_keeps_hpack_in_step() -> None:
    """A small block that references a big table entry many times (decoded, 90 KB)."""
    p = Peers(limits(max_header_list_bytes=16384))
    enc = Encoder()
    first = enc.encode([(":method", "POST"), (":path", VERSION), ("x-big", "v" * 3000)])
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, first))
    assert [t for t, *_ in p.runtime_got()] == [http2.HEADERS]
    big_index = bytes([0x80 | 63])  # x-big, once :path REMOVE is in the table too
    block = enc.encode([(":method", "POST"), (":path", REMOVE)])
    block += big_index * 30
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 3, block))
    assert rst(p.client_got(), 3) == http2.FRAME_SIZE_ERROR
    got = p.runtime_got()
    # the block changed the client's table, so the runtime still decodes it, but on a
    # stream that never ends with a request and is cancelled at once
    assert [(t, s) for t, _, s, _ in got] == [(http2.HEADERS, 3), (http2.RST_STREAM, 3)]
    assert not got[0][1] & http2.END_STREAM
    p.from_client(headers(5, VERSION, end_stream=True))
    assert [(t, s) for t, _, s, _ in p.runtime_got()] == [(http2.HEADERS, 5)]


def test_table_size_above_what_the_runtime_advertised_is_a_compression_error_once_acknowledged() -> None:
    p = Peers()
    p.from_runtime(http2.settings_frame({http2.SETTINGS_HEADER_TABLE_SIZE: 0}))
    p.client_got()
    enc = Encoder()
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, enc.encode([(":path", VERSION)])))
    p.from_client(http2.frame(http2.SETTINGS, http2.ACK, 0) * 2)  # the client got both of the runtime's SETTINGS
    p.runtime_got()
    update_to_4096 = b"\x3f\xe1\x1f"
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 3, update_to_4096 + request_block(VERSION)))
    closed_with(p, http2.COMPRESSION_ERROR)
    assert p.runtime_got() == []


def test_the_client_may_use_the_default_table_toward_a_runtime_that_advertises_none() -> None:
    """Relayed header blocks that index the dynamic table reach the runtime as they are,
    and the shim's copy of the table stays in step to read the next :path."""
    p = Peers()
    p.from_client(http2.frame(http2.SETTINGS, http2.ACK, 0))
    enc = Encoder()
    paths = [VERSION, "/runtime.v1.RuntimeService/ListContainers", VERSION, VERSION]
    blocks = [enc.encode([(":method", "POST"), (":path", path), ("te", "trailers")]) for path in paths]
    assert len(blocks[3]) == 3  # three indexed fields: the table is in use
    for i, block in enumerate(blocks):
        p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 2 * i + 1, block))
    got = [(s, payload) for t, _, s, payload in p.runtime_got() if t == http2.HEADERS]
    assert got == [(2 * i + 1, block) for i, block in enumerate(blocks)]
    update_to_8192 = b"\x3f\xe1\x3f"
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 9, update_to_8192 + request_block(VERSION)))
    closed_with(p, http2.COMPRESSION_ERROR)  # above the 4096 bytes the client was allowed


def test_table_size_update_to_zero_is_fine() -> None:
    p = Peers()
    p.from_client(http2.frame(http2.SETTINGS, http2.ACK, 0))
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, b"\x20" + request_block(VERSION)))
    assert [t for t, *_ in p.runtime_got()] == [http2.SETTINGS, http2.HEADERS]


def test_path_cache_is_bounded_by_bytes() -> None:
    p = Peers(limits(path_cache_bytes=4096, max_concurrent_streams=200))  # all 200 streams stay open
    for i in range(200):
        sid = 2 * i + 1
        p.from_client(headers(sid, f"/vendor.v1.Service/Method{i:04d}" + "x" * 100, end_stream=True))
    assert len(p.runtime_got()) == 200
    assert p.core.decoder.cache_use().bytes <= 4096
    assert 0 < p.core.decoder.cache_use().paths < 200


def settings_values(payload: bytes) -> dict[int, int]:
    values = {}
    for i in range(0, len(payload), 6):  # the last value of a setting wins
        values[int.from_bytes(payload[i:i + 2], "big")] = int.from_bytes(payload[i + 2:i + 6], "big")
    return values


@pytest.mark.parametrize("runtime_table, client_table", [(None, 4096), (0, 0), (1024, 1024), (1 << 20, 4096)])
def test_runtime_settings_reach_the_client_with_the_table_size_capped_and_the_header_list_limit(
        runtime_table: int | None, client_table: int) -> None:
    """The shim mirrors the client's HPACK table toward the runtime: at most 4096 bytes."""
    p = Peers(limits(max_header_list_bytes=20000))
    sent = {http2.SETTINGS_MAX_HEADER_LIST_SIZE: 1 << 24}
    if runtime_table is not None:
        sent[http2.SETTINGS_HEADER_TABLE_SIZE] = runtime_table
    p.from_runtime(http2.settings_frame(sent))
    [(t, f, _, payload)] = p.client_got()
    values = settings_values(payload)
    assert values[http2.SETTINGS_HEADER_TABLE_SIZE] == client_table and values[http2.SETTINGS_MAX_HEADER_LIST_SIZE] == 20000


def test_client_settings_reach_the_runtime_as_they_are() -> None:
    """The runtime's HPACK table toward the client is the client's business: the shim's own
    header blocks neither index nor insert (http2.encode_headers)."""
    p = Peers()
    frame = http2.settings_frame({http2.SETTINGS_HEADER_TABLE_SIZE: 65536, http2.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20})
    p.from_client(frame)
    assert p.core.take_runtime() == frame


# ------------------------------------------------------------------ GOAWAY


@pytest.mark.parametrize("path", [REMOVE, VERSION])
def test_new_streams_after_the_shims_goaway_are_refused_and_never_relayed(path: str) -> None:
    p = Peers()
    p.from_client(headers(1, VERSION))
    p.runtime_got()
    p.core.begin_shutdown()
    assert goaway_code(p.client_got()) == http2.NO_ERROR
    p.from_client(headers(3, path) + data(3, message(b"\x0a\x05nginx"), end_stream=True))
    got = p.client_got()
    assert rst(got, 3) == http2.REFUSED_STREAM
    assert p.events() == []  # no handler runs
    p.from_client(data(1, message(b""), end_stream=True))  # the stream opened before goes on
    assert [(t, s) for t, _, s, _ in p.runtime_got()] == [(http2.DATA, 1)]


def test_goaway_refusal_keeps_the_runtimes_hpack_table_in_step_without_a_request() -> None:
    p = Peers()
    p.core.begin_shutdown()
    p.client_got()
    block = Encoder().encode([(":method", "POST"), (":path", REMOVE), ("x-a", "b")])
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, block) + data(1, b"x"))
    got = p.runtime_got()
    assert [(t, s) for t, _, s, _ in got] == [(http2.HEADERS, 1), (http2.RST_STREAM, 1)]
    assert not got[0][1] & http2.END_STREAM  # the runtime waits for a body it never gets
    assert rst(p.client_got(), 1) == http2.REFUSED_STREAM


# ------------------------------------------------------------------ intercepted streams


def test_intercepted_call_is_answered_locally_and_its_data_refunded() -> None:
    p = Peers()
    p.from_client(headers(1, PULL) + data(1, message(b"\x0a\x00")))
    assert p.runtime_got() == []
    wus = [(s, int.from_bytes(pl, "big")) for t, _, s, pl in p.client_got() if t == http2.WINDOW_UPDATE]
    assert wus == [(0, 7), (1, 7)]
    p.from_client(data(1, b"", end_stream=True))
    [ev] = p.events()
    assert isinstance(ev, Request) and ev.stream.path == PULL and bytes(ev.stream.body) == message(b"\x0a\x00")
    s = ev.stream
    p.core.calls.send_headers(s)
    p.core.calls.send_data(s, message(b"ok"))
    p.core.calls.send_trailers(s, [(b"grpc-status", b"0")])
    got = p.client_got()
    assert [(t, sid) for t, _, sid, _ in got] == [(http2.HEADERS, 1), (http2.DATA, 1), (http2.HEADERS, 1)]
    assert grpc_status(got, 1) == (0, "")
    assert p.runtime_got() == []


def test_data_beyond_the_stream_window_is_a_flow_control_error() -> None:
    p = Peers()
    p.from_client(headers(1, PULL))
    p.client_got()
    body = message(b"x" * (8 * 16384 - 5))
    burst = b"".join(data(1, body[i:i + 16384]) for i in range(0, len(body), 16384))  # 128 KiB on a 64 KiB window
    p.from_client(burst)
    got = p.client_got()
    assert rst(got, 1) == http2.FLOW_CONTROL_ERROR
    assert p.runtime_got() == []
    # the connection window of every byte is refunded (the runtime never saw them)
    assert sum(int.from_bytes(pl, "big") for t, _, s, pl in got if t == http2.WINDOW_UPDATE and s == 0) == 8 * 16384


def test_frames_for_a_stream_the_shim_refused_are_consumed_and_refunded_never_forwarded() -> None:
    p = Peers(limits(max_message_bytes=1024))
    p.from_client(headers(1, PULL) + data(1, b"x" * 2000))
    got = p.client_got()
    assert grpc_status(got, 1)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert rst(got, 1) == http2.NO_ERROR  # stop sending
    p.from_client(data(1, b"y" * 5000) + http2.window_update(1, 100) + http2.frame(http2.PRIORITY, 0, 1, b"\0\0\0\0\x10")
                  + http2.rst_stream(1, http2.CANCEL) + data(1, b"z" * 10, end_stream=True))
    assert p.runtime_got() == []
    got = p.client_got()
    assert sum(int.from_bytes(pl, "big") for t, _, s, pl in got if t == http2.WINDOW_UPDATE and s == 0) == 5010
    assert goaway_code(got) is None


def test_client_reset_cancels_the_handler_and_later_frames_are_consumed() -> None:
    p = Peers()
    p.from_client(headers(1, PULL, end_stream=True))
    [ev] = p.events()
    p.from_client(http2.rst_stream(1, http2.CANCEL) + http2.window_update(1, 10))
    assert p.events() == [Cancelled(1)]
    assert p.runtime_got() == []
    assert p.core.stream_gone(ev.stream)


def test_window_update_zero_on_an_intercepted_stream_resets_it() -> None:
    p = Peers()
    p.from_client(headers(1, PULL, end_stream=True))
    p.events()
    p.from_client(http2.window_update(1, 0))
    assert rst(p.client_got(), 1) == http2.PROTOCOL_ERROR
    assert p.events() == [Cancelled(1)]
    assert p.runtime_got() == []


def test_intercepted_streams_per_connection_are_capped() -> None:
    p = Peers(limits(max_intercepted_streams=2))
    p.from_client(headers(1, PULL, end_stream=True) + headers(3, PULL, end_stream=True)
                  + headers(5, PULL, end_stream=True))
    assert len(p.events()) == 2
    code, msg = grpc_status(p.client_got(), 5)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "server.max_intercepted_streams" in msg
    assert p.runtime_got() == []


def test_client_settings_decrease_applies_on_receipt_and_increase_at_the_runtimes_ack() -> None:
    p = Peers()
    p.from_client(headers(1, PULL, end_stream=True))
    [ev] = p.events()
    s: LocalStream = ev.stream
    assert p.core.calls.send_room(s) == http2.DEFAULT_MAX_FRAME
    p.from_client(http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 100}))
    assert p.core.calls.send_room(s) == 100  # at once
    p.from_client(http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20}))
    assert p.core.calls.send_room(s) == 100
    p.from_runtime(http2.frame(http2.SETTINGS, http2.ACK, 0))  # ACK of the first
    assert p.core.calls.send_room(s) == 100
    p.from_runtime(http2.frame(http2.SETTINGS, http2.ACK, 0))  # ACK of the second
    assert p.core.calls.send_room(s) == http2.DEFAULT_MAX_FRAME
    assert [t for t, *_ in p.runtime_got()] == [http2.SETTINGS, http2.SETTINGS]


def test_shims_frames_never_land_inside_a_runtime_header_block() -> None:
    p = Peers()
    p.from_client(headers(1, VERSION, end_stream=True) + headers(3, PULL, end_stream=True))
    [ev] = p.events()
    p.runtime_got()
    p.client_got()
    block = http2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
    p.from_runtime(http2.frame(http2.HEADERS, 0, 1, block[:3]))
    p.core.calls.answer_error(ev.stream, grpc.StatusCode.NOT_FOUND, "no")
    assert [(t, s) for t, _, s, _ in p.client_got()] == [(http2.HEADERS, 1)]
    p.from_runtime(http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, block[3:]))
    assert [(t, s) for t, _, s, _ in p.client_got()] == [(http2.CONTINUATION, 1), (http2.HEADERS, 3)]


def test_trailers_after_end_stream_on_an_intercepted_stream_are_a_stream_error() -> None:
    p = Peers()
    p.from_client(headers(1, PULL, end_stream=True))
    p.events()
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, http2.encode_headers([(b"x", b"y")])))
    assert rst(p.client_got(), 1) == http2.STREAM_CLOSED


# ------------------------------------------------------------------ no runtime


def test_without_a_runtime_the_core_is_the_server() -> None:
    p = Peers(relay=False)
    p.from_client(http2.settings_frame({}) + http2.frame(http2.PING, 0, 0, b"p" * 8) + headers(1, VERSION)
                  + data(1, message(b"abc"), end_stream=True))
    got = p.client_got()
    assert (http2.SETTINGS, http2.ACK, 0, b"") in got
    assert (http2.PING, http2.ACK, 0, b"p" * 8) in got
    code, msg = grpc_status(got, 1)
    assert code == grpc.StatusCode.UNAVAILABLE.value[0] and "not reachable" in msg
    assert sum(int.from_bytes(pl, "big") for t, _, s, pl in got if t == http2.WINDOW_UPDATE and s == 0) == 8
    p.from_client(data(9, b"x"))  # DATA on an idle stream
    closed_with(p, http2.PROTOCOL_ERROR)


def test_runtime_lost_with_a_local_call_running_answers_relayed_calls_and_refuses_new_ones() -> None:
    p = Peers()
    p.from_client(headers(1, VERSION, end_stream=True) + headers(3, PULL, end_stream=True))
    [ev] = p.events()
    p.runtime_got()
    assert p.core.runtime_lost() is False
    got = p.client_got()
    assert goaway_code(got) == http2.NO_ERROR and grpc_status(got, 1)[0] == grpc.StatusCode.UNAVAILABLE.value[0]
    p.from_client(headers(5, PULL, end_stream=True) + data(1, b"late"))
    got = p.client_got()
    assert rst(got, 5) == http2.REFUSED_STREAM and goaway_code(got) is None
    p.core.calls.send_trailers(ev.stream, [(b"grpc-status", b"0")])
    assert grpc_status(p.client_got(), 3) == (0, "")


def test_decoder_that_skips_undecodable_entries_stays_in_step_with_a_full_decoder() -> None:
    """Entries that can't fit are not Huffman-decoded; the table must still match hpack's."""
    import random

    from hpack import Decoder as Reference

    rng = random.Random(13)
    enc, ref, mine = Encoder(), Reference(), Decoder()
    ref.max_allowed_table_size = mine.allowed_max = 8192
    for i in range(400):
        if rng.random() < 0.1:
            enc.header_table_size = rng.choice([0, 256, 4096, 8192])
        fields = [(":method", "POST"), (":path", f"/s.v{rng.randint(0, 3)}/M{rng.randint(0, 50)}")]
        for _ in range(rng.randint(0, 4)):
            size = rng.choice([1, 10, 100, 1500, 5000, 9000])
            fields.append((f"x-{rng.randint(0, 9)}", "".join(rng.choice("abcdefghij0123456789") for _ in range(size))))
        block = enc.encode(fields, huffman=rng.random() < 0.7)
        expected = ref.decode(block, raw=True)
        path, _, _ = mine.decode(block)
        assert path == dict(expected)[b":path"]
        assert mine.dynamic == list(ref.header_table.dynamic_entries), f"block {i}"
        assert mine.size == sum(32 + len(n) + len(v) for n, v in ref.header_table.dynamic_entries)  # RFC 7541 4.1


def test_a_remembered_header_block_is_forgotten_when_the_table_changes() -> None:
    """The same indexed block names another :path once an insertion moved the entries."""
    enc, mine = Encoder(), Decoder()
    first = enc.encode([(":path", "/a")])  # literal, indexed: /a is entry 62
    assert mine.path_of(first)[0] == b"/a"
    again = enc.encode([(":path", "/a")])
    assert again == b"\xbe"
    assert mine.path_of(again) == (b"/a", None)
    assert mine.path_of(again) == (b"/a", None)  # remembered
    assert mine.path_of(enc.encode([(":path", "/b")]))[0] == b"/b"  # /b is 62 now, /a 63
    same_bytes = enc.encode([(":path", "/b")])
    assert same_bytes == again
    assert mine.path_of(same_bytes) == (b"/b", None)


def test_remembered_blocks_agree_with_a_full_decoder_and_stay_within_the_cache_bytes() -> None:
    import random

    from hpack import Decoder as Reference

    rng = random.Random(7)
    enc, ref, mine = Encoder(), Reference(), Decoder(path_cache_bytes=2048)
    ref.max_allowed_table_size = mine.allowed_max = 4096
    for i in range(3000):
        if rng.random() < 0.02:
            enc.header_table_size = rng.choice([0, 256, 4096])
        fields = [(":method", "POST"), (":path", f"/s.v1/M{rng.randint(0, 12)}"),
                  ("grpc-timeout", f"{rng.randint(1, 3)}S")]
        if rng.random() < 0.05:
            fields.append(("x-new", str(i)))  # inserts: the table changes
        block = enc.encode(fields)
        expected = dict(ref.decode(block, raw=True))[b":path"]
        path, before = mine.path_of(block)
        assert path == expected, f"block {i}"
        assert mine.dynamic == list(ref.header_table.dynamic_entries), f"block {i}"
        assert mine.cache_use().bytes <= 2048
    assert mine.cache_use().blocks  # the repeated blocks were remembered


def test_a_remembered_block_still_counts_against_the_header_list_limit() -> None:
    from shim.relay.hpack_decoder import HeaderListTooLarge

    enc, mine = Encoder(), Decoder(max_list_size=1 << 16)
    mine.path_of(enc.encode([(":path", "/a"), ("x-big", "v" * 100)]))
    block = enc.encode([(":path", "/a"), ("x-big", "v" * 100)])
    assert mine.path_of(block)[0] == b"/a"
    mine.max_list_size = 100
    with pytest.raises(HeaderListTooLarge):
        mine.path_of(block)


def test_the_runtimes_pings_are_answered_by_the_shim_and_never_reach_the_client() -> None:
    p = Peers()
    p.from_runtime(http2.frame(http2.PING, 0, 0, b"bdp-ping"))
    assert p.client_got() == []
    assert p.runtime_got() == [(http2.PING, http2.ACK, 0, b"bdp-ping")]
    # its ACKs of the client's PINGs, and PINGs that break the frame layer, go to the client
    p.from_runtime(http2.frame(http2.PING, http2.ACK, 0, b"client-p"))
    p.from_runtime(http2.frame(http2.PING, 0, 0, b"short"))
    assert [(t, f, payload) for t, f, _, payload in p.client_got()] == [(http2.PING, http2.ACK, b"client-p"),
                                                                       (http2.PING, 0, b"short")]
    assert p.runtime_got() == []


def test_while_the_runtime_reads_slowly_its_pings_go_to_the_client() -> None:
    """The shim adds none of its own frames to what the runtime has not read."""
    p = Peers()
    p.core.runtime_reads_slowly(True)
    p.from_runtime(http2.frame(http2.PING, 0, 0, b"keepaliv"))
    assert p.runtime_got() == []
    assert [(t, f, payload) for t, f, _, payload in p.client_got()] == [(http2.PING, 0, b"keepaliv")]
    p.from_client(http2.frame(http2.PING, http2.ACK, 0, b"keepaliv"))
    assert p.runtime_got() == [(http2.PING, http2.ACK, 0, b"keepaliv")]


GOOD = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b":authority", b"x"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")]


@pytest.mark.parametrize("fields", [
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b"X-Upper", b"v")],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b":unknown", b"v")],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b":status", b"200")],
    [(b":method", b"POST"), (b":scheme", b"http"), (b"x-a", b"b"), (b":path", PULL.encode())],
    [(b":scheme", b"http"), (b":path", PULL.encode())],
    [(b":method", b"POST"), (b":path", PULL.encode())],
    [(b":method", b"POST"), (b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode())],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":scheme", b"http"), (b":path", PULL.encode())],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b":path", PULL.encode())],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b"connection", b"close")],
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()), (b"te", b"gzip")],
], ids=["uppercase", "unknown-pseudo", "response-pseudo", "pseudo-after-regular", "no-method", "no-scheme",
        "two-methods", "two-schemes", "two-paths", "connection", "te-not-trailers"])
def test_malformed_intercepted_request_is_a_stream_protocol_error(fields) -> None:
    p = Peers()
    p.from_client(http2.headers_frames(1, http2.encode_headers(fields), True, http2.DEFAULT_MAX_FRAME))
    assert rst(p.client_got(), 1) == http2.PROTOCOL_ERROR
    assert p.events() == [] and p.runtime_got() == []
    p.from_client(http2.headers_frames(3, http2.encode_headers(GOOD), True, http2.DEFAULT_MAX_FRAME))
    [ev] = p.events()
    assert isinstance(ev, Request) and ev.stream.sid == 3


def test_pseudo_header_in_trailers_is_a_stream_protocol_error() -> None:
    p = Peers()
    p.from_client(http2.headers_frames(1, http2.encode_headers(GOOD), False, http2.DEFAULT_MAX_FRAME))
    p.from_client(http2.headers_frames(1, http2.encode_headers([(b":method", b"POST")]), True, http2.DEFAULT_MAX_FRAME))
    assert rst(p.client_got(), 1) == http2.PROTOCOL_ERROR
    assert p.events() == []


@pytest.mark.parametrize("answered", [False, True])
def test_data_after_the_clients_end_stream_is_stream_closed(answered: bool) -> None:
    """half-closed (remote), and closed after the client's END_STREAM: STREAM_CLOSED."""
    p = Peers()
    p.from_client(headers(1, PULL, end_stream=True))
    [ev] = p.events()
    if answered:
        p.core.calls.answer_error(ev.stream, grpc.StatusCode.NOT_FOUND, "no")
    p.client_got()
    p.from_client(data(1, b"late"))
    got = p.client_got()
    assert rst(got, 1) == http2.STREAM_CLOSED
    assert sum(int.from_bytes(pl, "big") for t, _, s, pl in got if t == http2.WINDOW_UPDATE and s == 0) == 4
    assert p.runtime_got() == []


def test_requests_share_one_process_wide_budget_until_their_handler_ends() -> None:
    """Header list and body count from the first frame until the handler ends (not when the
    request is complete: the handler holds it), however the stream ends."""
    from shim.relay.memory import header_bytes

    budget = Pool(3000)
    a, b = Peers(limits(request_buffer=budget)), Peers(limits(request_buffer=budget))
    a.from_client(headers(1, PULL) + data(1, message(b"x" * 2000)[:800]))  # a slow sender, never ending its request
    hdr = budget.used - 800
    assert hdr == header_bytes([(b":method", b"POST"), (b":scheme", b"http"), (b":path", PULL.encode()),
                                (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    b.from_client(headers(1, PULL) + data(1, message(b"y" * 2000)[:2000]))
    code, msg = grpc_status(b.client_got(), 1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "server.max_request_buffer_bytes" in msg
    assert budget.used == hdr + 800  # the refused request holds nothing
    a.from_client(http2.rst_stream(1, http2.CANCEL))  # the slow sender gives up: its bytes are free again
    assert budget.used == 0
    b.from_client(headers(3, PULL) + data(3, message(b"y" * 295), end_stream=True))
    [ev] = b.events()
    assert isinstance(ev, Request) and len(ev.stream.body) == 300
    assert budget.used == hdr + 300  # complete, handed to the handler: still held
    b.core.calls.answer_error(ev.stream, grpc.StatusCode.NOT_FOUND, "no")  # answered...
    b.core.calls.release_all()  # ...and the connection closed, but the handler still runs
    assert budget.used == hdr + 300
    b.core.calls.handler_ended(ev.stream)
    b.core.calls.handler_ended(ev.stream)  # twice is harmless
    assert budget.used == 0
    a.from_client(headers(3, PULL) + data(3, b"\0\0\0\x04\0" + b"z" * 895))
    assert budget.used == hdr + 900
    a.core.calls.release_all()  # the connection closed
    assert budget.used == 0


def test_a_request_over_its_methods_limit_is_refused_on_its_declared_length() -> None:
    """As grpc-go: RESOURCE_EXHAUSTED "received message larger than max", before the body is buffered."""
    budget = Pool(64 << 20)
    p = Peers(limits(request_buffer=budget, max_request_bytes=(("PullImage", 4096),)))
    p.from_client(headers(1, PULL) + data(1, b"\0" + (15 << 20).to_bytes(4, "big") + b"x" * 100))
    code, msg = grpc_status(p.client_got(), 1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert msg == f"cri-shim: received message larger than max ({15 << 20} vs. 4096) (server.max_request_bytes.PullImage)"
    assert budget.used == 0 and p.events() == []
    p.from_client(headers(3, REMOVE) + data(3, message(b"r" * 5000), end_stream=True))  # no entry: max_message_bytes
    [ev] = p.events()
    assert isinstance(ev, Request) and ev.stream.limit_key == "server.max_message_bytes"


def test_intercepted_calls_at_once_are_capped_over_all_connections_with_room_kept_for_trusted_clients() -> None:
    calls = Pool(4)
    kubelet = Peers(limits(calls=calls))
    other, other2 = (Peers(limits(calls=calls), trusted=False) for _ in range(2))
    for sid in (1, 3):
        other.from_client(headers(sid, PULL, end_stream=True))
    assert len(other.events()) == 2  # the untrusted share (half) is taken
    other2.from_client(headers(1, PULL, end_stream=True))
    code, msg = grpc_status(other2.client_got(), 1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "clients outside server.trusted_uids" in msg and "server.max_intercepted_calls" in msg
    kubelet.from_client(headers(1, PULL, end_stream=True) + headers(3, PULL, end_stream=True))
    assert len(kubelet.events()) == 2  # the reserved half
    kubelet.from_client(headers(5, PULL, end_stream=True))
    assert grpc_status(kubelet.client_got(), 5)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert calls.used == 4 and calls.untrusted == 2


def test_a_request_whose_body_does_not_arrive_is_ended_after_the_stall_timeout() -> None:
    now = [100.0]
    budget = Pool(1 << 20)
    core = RelayCore(limits(request_buffer=budget), ROUTE, clock=lambda: now[0])
    p = Peers.__new__(Peers)
    p.core = core
    core.receive_client(http2.PREFACE)
    core.start_relay()
    core.take_events(), core.take_client(), core.take_runtime()
    p.from_client(headers(1, PULL) + data(1, message(b"x" * 100)[:50]))
    now[0] = 105.0
    p.from_client(headers(3, PULL))
    assert core.calls.expire_incomplete(now[0] - 10, 10) == 100.0  # not yet: both younger than 10 s
    now[0] = 111.0
    assert core.calls.expire_incomplete(now[0] - 10, 10) == 105.0  # stream 1 ended, stream 3 remains
    code, msg = grpc_status(p.client_got(), 1)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "server.stream_stall_seconds" in msg
    assert 1 not in core.local and 3 in core.local
    assert core.calls.incomplete
    core.calls.release_all()
    assert budget.used == 0

def test_headers_after_the_client_reset_an_intercepted_stream_is_stream_closed() -> None:
    p = Peers()
    p.from_client(headers(1, PULL))
    p.from_client(http2.rst_stream(1, http2.CANCEL))
    p.from_client(headers(1, PULL, end_stream=True))
    assert rst(p.client_got(), 1) == http2.STREAM_CLOSED
    assert p.runtime_got() == [] and p.events() == []


def test_pings_without_data_in_between_are_limited_but_pings_after_data_are_not() -> None:
    now = [0.0]
    core = RelayCore(limits(), ROUTE, clock=lambda: now[0])
    p = Peers.__new__(Peers)
    p.core = core
    core.receive_client(http2.PREFACE)
    core.start_local("cri-shim: no runtime")
    p.client_got()
    ping = http2.frame(http2.PING, 0, 0, b"p" * 8)
    for i in range(300):  # a client answered by the shim, PINGing after each answer (BDP probes)
        sid = 2 * i + 1
        p.from_client(headers(sid, VERSION, end_stream=True) + ping)
    assert goaway_code(p.client_got()) is None
    p.from_client(ping * 100)  # the burst
    assert goaway_code(p.client_got()) is None
    now[0] += 1.0
    p.from_client(ping * 10)  # ten a second after it
    assert goaway_code(p.client_got()) is None
    p.from_client(ping)
    closed_with(p, http2.ENHANCE_YOUR_CALM)


def test_runtime_answer_on_a_stream_the_shim_answers_never_reaches_the_client() -> None:
    """The runtime had to decode the block (it changed the HPACK table), may answer before it
    reads our RST_STREAM: trailers, then RST_STREAM(NO_ERROR). The client sees only the shim's answer."""
    p = Peers()
    block = Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PULL), (":authority", "x")])
    p.from_client(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, block))
    [ev] = p.events()
    assert [(t, s) for t, _, s, _ in p.runtime_got()] == [(http2.HEADERS, 1), (http2.RST_STREAM, 1)]
    trailers = http2.encode_headers([(b":status", b"200"), (b"grpc-status", b"12")])
    p.from_runtime(http2.frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, 1, trailers) + data(1, b"x")
                   + http2.rst_stream(1, http2.NO_ERROR) + http2.window_update(0, 7))
    assert [(t, s) for t, _, s, _ in p.client_got()] == [(http2.WINDOW_UPDATE, 0)]
    assert [(t, s) for t, _, s, _ in p.runtime_got()] == [(http2.WINDOW_UPDATE, 0)]  # its DATA's window back
    p.core.calls.send_trailers(ev.stream, [(b"grpc-status", b"0")])
    assert grpc_status(p.client_got(), 1) == (0, "")


def test_a_refused_service_is_answered_with_its_status_and_never_relayed() -> None:
    p = Peers(limits())
    p.from_client(headers(1, "/containerd.services.images.v1.Images/Delete", end_stream=True))
    p.from_client(headers(3, "/runtime.v1alpha2.ImageService/RemoveImage", end_stream=True))
    p.from_client(http2.headers_frames(5, request_block("/containerd.services.images.v1.Images/Delete")
                                    + request_block("/x"), True, http2.DEFAULT_MAX_FRAME))  # malformed: judged first
    assert p.runtime_got() == []
    got = p.client_got()
    assert grpc_status(got, 1)[0] == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert grpc_status(got, 3) == (grpc.StatusCode.UNIMPLEMENTED.value[0], "unknown service runtime.v1alpha2.ImageService")
    assert rst(got, 5) == http2.PROTOCOL_ERROR and grpc_status(got, 5) is None
