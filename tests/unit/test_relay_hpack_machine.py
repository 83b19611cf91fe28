"""The client's HPACK table stays in step with the runtime's encoder (shim/relay/core.py), as a state machine.

The relay passes the runtime's header blocks to the client byte for byte, so the client's
HPACK decoder must see every block the runtime's encoder produced that changed its dynamic
table, in the runtime's order. The shim's own blocks are literals that index nothing. A
stream the shim answers itself whose client block changed the table goes to the runtime
only to keep the runtime's decoder in step, then RST_STREAM CANCEL; the runtime may still
answer it (grpc-go: trailers, then RST_STREAM NO_ERROR) with blocks that change its
encoder's table.

``HpackMachine`` plays a client (a real ``hpack.Encoder``: first uses insert, later ones
index; it resets intercepted calls now and then), one runtime (one real ``hpack.Encoder``
whose table the client must mirror; table size updates now and then; cancelled calls often
answered at once, as CRI-O does) and the shim's handlers (``core.calls``: trailers, an error,
headers + DATA + trailers, or RST_STREAM), in random order, with time passing
(``expire_carried``), the runtime's bytes delivered in random pieces and the client's
connection window opened a little at a time. What the client would notice, checked after
every step:

- one ``hpack.Decoder`` fed every header block the client gets (the shim's and the
  runtime's, any stream, in order) never fails, and every runtime block it gets decodes to
  what the runtime encoded (each relayed stream's answer exactly);
- the runtime's blocks reach it in the runtime's order;
- on a stream the shim answers, the first END_STREAM or RST_STREAM is the shim's (its
  grpc-status, or CANCEL), the only DATA is the shim's, and runtime blocks come after the
  shim's end (or the client's reset);
- nothing is lost: once the shim's answers have ended, the runtime's bytes are all read and
  the client's window has room, every runtime block of a relayed stream and every one that
  changed the table has reached the client; at the end every answer could end (none was left
  without room for its DATA).

Examples: ``CRI_SHIM_HPACK_MACHINE_EXAMPLES`` (default 300, under 10 s; 1,000 in 20-35 s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc
from hpack import Decoder as ClientDecoder
from hpack import Encoder
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim.relay import http2
from shim.relay.core import RelayCore
from shim.relay.events import Cancelled, PrefaceReceived, Request
from shim.relay.streams import LocalStream
from tests.unit.test_relay_core import PULL, REMOVE, ROUTE, VERSION, limits, message, parse

EXAMPLES = int(os.environ.get("CRI_SHIM_HPACK_MACHINE_EXAMPLES", "300"))
NO_SHRINK = os.environ.get("CRI_SHIM_HPACK_MACHINE_NO_SHRINK") == "1"
STALL = 30.0  # server.stream_stall_seconds, as the adapter passes it
MAX_STREAMS = 14  # per example: well under server.max_concurrent_streams and max_intercepted_streams

Headers = list[tuple[bytes, bytes]]

RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
STATUSES = [b"0", b"2", b"5", b"12"]
MESSAGES = [b"not found", b"boom", b"unknown method", b"try again"]
SHIM_CODES = [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.RESOURCE_EXHAUSTED]


@dataclass
class Part:
    """One thing the runtime sends on a stream: a header block, DATA or RST_STREAM."""

    kind: str  # "block", "data" or "rst"
    headers: Headers = field(default_factory=list)
    end_stream: bool = False
    payload: bytes = b""
    code: int = 0


@dataclass
class Sent:
    """A header block the runtime's encoder produced, in the order it produced them."""

    sid: int
    block: bytes
    headers: Headers
    changed: bool  # it inserted into the encoder's table or carried a table size update


@dataclass
class Got:
    """What the client got on a stream, in order: a decoded header block, DATA or RST_STREAM."""

    kind: str  # "block", "data" or "rst"
    end_stream: bool
    block: bytes = b""
    headers: Headers = field(default_factory=list)
    payload: bytes = b""
    code: int = 0


@dataclass
class Answer:
    """The shim's answer to a stream it handles: its plan and what went out."""

    mode: str  # "trailers", "error", "full" (response HEADERS, DATA, trailers) or "reset" (RST_STREAM CANCEL)
    code: grpc.StatusCode
    text: str
    body: bytes
    step: int = 0
    blocks: int = 0
    data: bytes = b""
    ended: bool = False
    reset: bool = False  # the shim ended it with RST_STREAM CANCEL (its handler, or server.stream_stall_seconds)
    client_reset_at: int | None = None  # the client reset it, after the frames it had got on it then


def request(path: str, extra: str | None) -> list[tuple[str, str]]:
    out = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
           ("content-type", "application/grpc"), ("te", "trailers")]
    if extra is not None:
        out.append(("x-call", extra))
    return out


def frames_of(sid: int, block: bytes, end_stream: bool, pieces: int) -> bytes:
    """``block`` as HEADERS and ``pieces - 1`` CONTINUATION frames."""
    cuts = sorted({len(block) * i // pieces for i in range(1, pieces)} - {0, len(block)})
    chunks = [block[a:b] for a, b in zip([0, *cuts], [*cuts, len(block)], strict=True)]
    out = b""
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        if i == 0:
            flags = (http2.END_STREAM if end_stream else 0) | (http2.END_HEADERS if last else 0)
            out += http2.frame(http2.HEADERS, flags, sid, chunk)
        else:
            out += http2.frame(http2.CONTINUATION, http2.END_HEADERS if last else 0, sid, chunk)
    return out


class HpackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = core = RelayCore(limits(), ROUTE, clock=lambda: self.now)
        core.receive_client(http2.PREFACE + http2.settings_frame({}))
        assert core.take_events() == [PrefaceReceived()]
        core.start_relay()
        core.receive_runtime(http2.settings_frame({}) + http2.frame(http2.SETTINGS, http2.ACK, 0))
        self.client_encoder = Encoder()
        self.runtime_encoder = Encoder()  # the table the client must mirror
        self.client_decoder = ClientDecoder()
        self.runtime_decoder = ClientDecoder()  # the runtime's, for the client's blocks
        self.next_sid = 1
        self.paths: dict[int, str] = {}  # every stream the client opened
        self.runtime_saw: set[int] = set()
        self.cancelled: set[int] = set()  # the runtime got its HEADERS, then RST_STREAM CANCEL
        self.plans: dict[int, list[Part]] = {}  # what the runtime still has to send, per stream
        self.wire = b""  # the runtime's bytes the core has not read yet
        self.sent: list[Sent] = []
        self.runtime_data: dict[int, int] = {}  # DATA bytes the runtime sent per stream
        self.local: dict[int, LocalStream] = {}
        self.answers: dict[int, Answer] = {}
        self.got: dict[int, list[Got]] = {}
        self.got_blocks: list[tuple[int, bytes]] = []  # every header block the client got, in order
        self.open_block: tuple[int, int, bytes] | None = None  # sid, flags, fragments so far
        self.granted = http2.DEFAULT_WINDOW  # the client's connection window, as it gave it
        self.received = 0  # DATA bytes the client got
        self.runtime_window = http2.DEFAULT_WINDOW  # the runtime's connection window toward the client, as it knows it
        self.take()

    # ------------------------------------------------------------------ both sides read

    def take(self) -> None:
        for ev in self.core.take_events():
            if isinstance(ev, Request):
                self.local[ev.stream.sid] = ev.stream
            elif isinstance(ev, Cancelled) and ev.sid in self.local:
                a = self.answers.setdefault(ev.sid, Answer("reset", grpc.StatusCode.CANCELLED, "", b""))
                if a.client_reset_at is None:  # the shim reset it: its handler is cancelled
                    a.ended = a.reset = True
        for t, f, s, p in parse(self.core.take_runtime()):
            if t == http2.HEADERS:
                self.runtime_decoder.decode(p, raw=True)  # the runtime's decoder stays in step too
                assert s in self.paths
                self.runtime_saw.add(s)
            elif t == http2.WINDOW_UPDATE and s == 0:
                self.runtime_window += int.from_bytes(p, "big")
            elif t == http2.RST_STREAM and s in self.runtime_saw and int.from_bytes(p, "big") == http2.CANCEL:
                self.cancelled.add(s)
        for t, f, s, p in parse(self.core.take_client()):
            assert t != http2.GOAWAY, "the connection ended"
            if t == http2.HEADERS or t == http2.CONTINUATION:
                if t == http2.HEADERS:
                    assert self.open_block is None, "HEADERS inside another header block"
                    self.open_block = (s, f, p)
                else:
                    assert self.open_block is not None and self.open_block[0] == s, "CONTINUATION out of a block"
                    self.open_block = (s, self.open_block[1], self.open_block[2] + p)
                if f & http2.END_HEADERS:
                    sid, flags, block = self.open_block
                    self.open_block = None
                    # one decoder for every block, in the order the client gets them: it must never fail
                    decoded = [(bytes(n), bytes(v)) for n, v in self.client_decoder.decode(block, raw=True)]
                    self.got_blocks.append((sid, block))
                    a = self.answers.get(sid)
                    if a is not None and sum(g.kind == "block" for g in self.got.get(sid, [])) >= a.blocks:
                        event("a runtime block reaches the client after the shim's answer")
                    self.got.setdefault(sid, []).append(Got("block", bool(flags & http2.END_STREAM), block=block,
                                                            headers=decoded))
                continue
            assert self.open_block is None, f"frame type {t} inside a header block"
            if t == http2.DATA:
                self.received += len(p)
                assert self.received <= self.granted, "DATA over the client's connection window"
                self.got.setdefault(s, []).append(Got("data", bool(f & http2.END_STREAM), payload=p))
            elif t == http2.RST_STREAM:
                self.got.setdefault(s, []).append(Got("rst", False, code=int.from_bytes(p, "big")))

    # ------------------------------------------------------------------ the client

    @precondition(lambda self: len(self.paths) < MAX_STREAMS)
    @rule(path=st.sampled_from([VERSION, PULL, REMOVE]), extra=st.sampled_from([None, "a", "b", "c", "d"]),
          with_body=st.booleans())
    def client_calls(self, path: str, extra: str | None, with_body: bool) -> None:
        if len(self.paths) >= MAX_STREAMS:
            return
        sid = self.next_sid
        self.next_sid += 2
        self.paths[sid] = path
        block = self.client_encoder.encode(request(path, extra))
        out = http2.frame(http2.HEADERS, http2.END_HEADERS | (0 if with_body else http2.END_STREAM), sid, block)
        if with_body:
            out += http2.frame(http2.DATA, http2.END_STREAM, sid, message(b"\x0a\x03img"))
        self.core.receive_client(out)
        self.take()
        if path != VERSION:
            assert sid in self.local, "an intercepted request complete: its handler runs"

    @rule(inc=st.integers(1, 60_000))
    def client_opens_its_window(self, inc: int) -> None:
        self.granted += inc
        self.core.receive_client(http2.window_update(0, inc))
        self.take()

    # ------------------------------------------------------------------ the runtime

    @precondition(lambda self: bool(self.runtime_saw - self.plans.keys()))
    @rule(data=st.data())
    def runtime_plans(self, data: st.DataObject, sid: int | None = None) -> None:
        """The runtime decides how it answers a stream it got (before or after our RST_STREAM)."""
        if sid is None:
            sid = data.draw(st.sampled_from(sorted(self.runtime_saw - self.plans.keys())))
        extra = data.draw(st.sampled_from([None, b"a", b"b", b"c"]))
        head = RESPONSE + ([(b"x-runtime", extra)] if extra is not None else [])
        trailers = [(b"grpc-status", data.draw(st.sampled_from(STATUSES))),
                    (b"grpc-message", data.draw(st.sampled_from(MESSAGES)))]
        full = [Part("block", head), Part("data", payload=message(b"r" * data.draw(st.integers(0, 20_000)))),
                Part("block", trailers, end_stream=True)]
        if sid in self.cancelled:
            mode = data.draw(st.sampled_from(["early", "full", "nothing"]))
            if mode == "early":  # CRI-O: an unknown method answered at once, then RST_STREAM NO_ERROR
                plan = [Part("block", RESPONSE + [(b"grpc-status", b"12"), (b"grpc-message", b"unknown method")],
                             end_stream=True), Part("rst", code=http2.NO_ERROR)]
            elif mode == "full":
                plan = full + ([Part("rst", code=http2.NO_ERROR)] if data.draw(st.booleans()) else [])
            else:
                plan = []
        elif data.draw(st.booleans()):
            plan = full
        else:  # trailers only
            plan = [Part("block", head + trailers, end_stream=True)]
        self.plans[sid] = plan

    @precondition(lambda self: bool(self.cancelled - self.plans.keys()))
    @rule(data=st.data())
    def runtime_answers_a_cancelled_call_at_once(self, data: st.DataObject) -> None:
        """CRI-O: a method it does not have is answered as soon as its HEADERS are read, before
        the RST_STREAM behind them; all of it reaches the shim now."""
        sid = data.draw(st.sampled_from(sorted(self.cancelled - self.plans.keys())))
        self.runtime_plans(data, sid)
        while self.plans[sid]:
            left = len(self.plans[sid])
            self.runtime_sends(data, sid)
            if len(self.plans[sid]) == left:  # DATA waiting for the window: the rest later
                break
        self.runtime_bytes_arrive(data, everything=True)

    @precondition(lambda self: any(self.plans.values()))
    @rule(data=st.data())
    def runtime_sends(self, data: st.DataObject, sid: int | None = None) -> None:
        """The runtime encodes and writes the next part of one stream's answer (encoded now: the
        encoder's table follows the order on the wire)."""
        if sid is None:
            sid = data.draw(st.sampled_from(sorted(s for s, plan in self.plans.items() if plan)))
        part = self.plans[sid].pop(0)
        if part.kind == "rst":
            self.wire += http2.rst_stream(sid, part.code)
        elif part.kind == "data":
            if len(part.payload) > self.runtime_window:  # it waits for the client's window (as grpc-go does)
                self.plans[sid].insert(0, part)
                return
            self.runtime_window -= len(part.payload)
            self.runtime_data[sid] = self.runtime_data.get(sid, 0) + len(part.payload)
            for i in range(0, len(part.payload), http2.DEFAULT_MAX_FRAME):  # the client's largest frame
                self.wire += http2.frame(http2.DATA, 0, sid, part.payload[i:i + http2.DEFAULT_MAX_FRAME])
        else:
            table = self.runtime_encoder.header_table
            changed = table.resized or any(
                (m := table.search(n, v)) is None or m[2] is None for n, v in part.headers)
            block = self.runtime_encoder.encode(part.headers)
            self.sent.append(Sent(sid, block, part.headers, changed))
            if sid in self.cancelled:
                event("the runtime answers a cancelled stream with a block that " + ("changes" if changed else "keeps")
                      + " its table")
            self.wire += frames_of(sid, block, part.end_stream, data.draw(st.integers(1, 3)))

    @rule(size=st.sampled_from([256, 1024, 2048, 4096]))
    def runtime_resizes_its_table(self, size: int) -> None:
        """A table size update (within the client's 4,096), sent at the start of its next block."""
        if size != self.runtime_encoder.header_table_size:  # hpack's Encoder forgets an update set twice
            self.runtime_encoder.header_table_size = size

    @precondition(lambda self: bool(self.wire))
    @rule(data=st.data())
    def runtime_bytes_arrive(self, data: st.DataObject, everything: bool = False) -> None:
        if not self.wire:
            return
        n = len(self.wire) if everything else data.draw(st.one_of(st.just(len(self.wire)),
                                                                  st.integers(1, len(self.wire))))
        chunk, self.wire = self.wire[:n], self.wire[n:]
        self.core.receive_runtime(chunk)
        self.take()

    @precondition(lambda self: any(s not in self.answers or not self.answers[s].ended for s in self.local))
    @rule(data=st.data())
    def client_resets_an_intercepted_call(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(s for s in self.local if s not in self.answers
                                               or not self.answers[s].ended)))
        a = self.answers.setdefault(sid, Answer("trailers", grpc.StatusCode.OK, "", b""))
        self.take()
        a.client_reset_at = len(self.got.get(sid, []))
        if self.core.carrying:
            event("the client resets a call while a runtime block waits")
        a.ended = True
        self.core.receive_client(http2.rst_stream(sid, http2.CANCEL))
        self.take()

    @rule(seconds=st.sampled_from([1.0, 10.0, 29.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        """server.stream_stall_seconds: an answer a runtime block waits behind that long is reset."""
        self.now += seconds
        method, _ = self.core.expire_carried(STALL)
        if method:
            event("an answer a runtime block waited behind for server.stream_stall_seconds is reset")
        self.take()

    # ------------------------------------------------------------------ the shim's handlers

    @precondition(lambda self: any(s not in self.answers or not self.answers[s].ended for s in self.local))
    @rule(data=st.data())
    def shim_answers(self, data: st.DataObject) -> None:
        open_ = sorted(s for s in self.local if s not in self.answers or not self.answers[s].ended)
        if not open_:
            return
        sid = data.draw(st.sampled_from(open_))
        a = self.answers.get(sid)
        if a is None:
            a = self.answers[sid] = Answer(data.draw(st.sampled_from(["trailers", "error", "full", "full", "reset", "reset"])),
                                           data.draw(st.sampled_from(SHIM_CODES)), data.draw(st.sampled_from(
                                               ["", "done", "no such image"])),
                                           b"s" * data.draw(st.integers(1, 3000)))
        self._answer_step(sid, a)
        self.take()

    def _answer_step(self, sid: int, a: Answer) -> None:
        calls, s = self.core.calls, self.local[sid]
        if a.mode == "reset":
            calls.reset(s, http2.CANCEL)
            self.take()  # Cancelled: the shim's reset ended it
            assert a.reset and a.ended
            return
        if a.mode == "full" and a.step == 0:
            calls.send_headers(s)
            a.blocks += 1
        elif a.mode == "full" and a.step == 1 and len(a.data) < len(a.body):
            room = calls.send_room(s)
            chunk = a.body[len(a.data):len(a.data) + room]
            if chunk:
                calls.send_data(s, chunk)
                a.data += chunk
            return  # the next step sends more, or the trailers
        elif a.mode == "error" or a.code is not grpc.StatusCode.OK and a.mode != "trailers":
            calls.answer_error(s, a.code, a.text)
            a.blocks += 1
            a.ended = True
        elif a.step >= 1 or a.mode == "trailers":
            status = [(b"grpc-status", str(a.code.value[0]).encode())]
            calls.send_trailers(s, status + ([(b"grpc-message", a.text.encode())] if a.text else []))
            a.blocks += 1
            a.ended = True
        a.step += 1

    # ------------------------------------------------------------------ what the client noticed

    def _runtime_blocks_got(self) -> list[tuple[int, bytes]]:
        """The runtime's blocks among those the client got, in order: every block on a stream the
        runtime answers, and those after the shim's own on a stream the shim answers."""
        out = []
        seen: dict[int, int] = {}
        for sid, block in self.got_blocks:
            seen[sid] = seen.get(sid, 0) + 1
            a = self.answers.get(sid)
            if self.paths[sid] == VERSION or (a is not None and seen[sid] > a.blocks):
                out.append((sid, block))
        return out

    @invariant()
    def runtime_blocks_arrive_as_encoded_and_in_order(self) -> None:
        sent = iter(self.sent)
        for sid, block in self._runtime_blocks_got():
            # a subsequence of what the runtime encoded, in its order, byte for byte
            for s in sent:
                if s.sid == sid and s.block == block:
                    break
            else:
                raise AssertionError(f"a runtime block on stream {sid} out of the runtime's order, or not the "
                                     "runtime's")
        for sid, got in self.got.items():
            blocks = [g for g in got if g.kind == "block"]
            if self.paths[sid] == VERSION:
                # the client decodes exactly what the runtime encoded for it
                assert [g.headers for g in blocks] == [s.headers for s in self.sent if s.sid == sid][:len(blocks)]
            else:
                a = self.answers.get(sid)
                ours = a.blocks if a is not None else 0
                by_runtime = {s.block: s.headers for s in self.sent if s.sid == sid}
                for g in blocks[ours:]:
                    assert g.block in by_runtime and g.headers == by_runtime[g.block], \
                        f"a runtime block on stream {sid} decodes to something else: the client's table is out of step"

    @invariant()
    def the_shim_answers_its_streams_first_and_alone(self) -> None:
        for sid, got in self.got.items():
            if self.paths[sid] == VERSION:
                continue
            a = self.answers.get(sid)
            ends = [i for i, g in enumerate(got) if g.end_stream or g.kind == "rst"]
            if a is not None and a.client_reset_at is not None:  # the client ended it: anything may follow
                ends = [i for i in ends if i < a.client_reset_at]
                assert not ends, f"stream {sid} ended before the shim answered it or the client reset it"
                assert sum(g.kind == "block" for g in got[:a.client_reset_at]) <= a.blocks, \
                    f"a runtime block on stream {sid} before the client reset it"
            elif not ends:  # the shim's answer has not ended, or waits behind a runtime block left open
                assert sum(g.kind == "block" for g in got) <= (a.blocks if a is not None else 0), \
                    f"a runtime block on stream {sid} before the shim's answer ended"
            else:
                assert a is not None and a.ended, f"stream {sid} ended before the shim answered it"
                first = got[ends[0]]
                if a.reset:
                    assert first.kind == "rst" and first.code == http2.CANCEL, \
                        f"stream {sid} first ended by a {first.kind}, not the shim's RST_STREAM CANCEL"
                else:
                    assert first.kind == "block", f"stream {sid} first ended by {first.kind}, not the shim's trailers"
                    status = dict(first.headers).get(b"grpc-status")
                    assert status == str(a.code.value[0]).encode(), \
                        f"stream {sid} first ended with grpc-status {status!r}, the shim chose {a.code.value[0]}"
                    if a.mode == "trailers" and a.text:
                        assert dict(first.headers).get(b"grpc-message") == a.text.encode()
                assert sum(g.kind == "block" for g in got[:ends[0] + 1]) == a.blocks, \
                    f"a runtime block on stream {sid} before the shim's answer ended"
                assert all(g.kind != "data" for g in got[ends[0]:]), f"runtime DATA on stream {sid}"
            # the only DATA is the shim's own
            assert (a.data if a is not None else b"").startswith(b"".join(g.payload for g in got if g.kind == "data")), \
                f"DATA on stream {sid} that the shim did not send"

    def _settled(self) -> bool:
        """The shim's answers have ended, the core read all the runtime sent, and the client's
        window has room for every byte of DATA the runtime sent on the streams it answers."""
        if self.wire or any(s not in self.answers or not self.answers[s].ended for s in self.local):
            return False
        runtime_data = sum(n for s, n in self.runtime_data.items() if self.paths[s] == VERSION)
        shims = sum(len(a.data) for a in self.answers.values())
        return self.granted >= runtime_data + shims

    @invariant()
    def nothing_the_runtime_sent_is_lost(self) -> None:
        if not self._settled():
            return
        got = set(self._runtime_blocks_got())
        for s in self.sent:
            if self.paths[s.sid] == VERSION or s.changed:
                assert (s.sid, s.block) in got, \
                    f"the runtime's block on stream {s.sid} ({'changed' if s.changed else 'kept'} its table) " \
                    "never reached the client"
        for sid, a in self.answers.items():  # the shim's whole answer reached the client, its end first
            got = self.got.get(sid, [])
            if a.client_reset_at is None:
                assert any(g.end_stream or g.kind == "rst" for g in got), \
                    f"the shim's answer on stream {sid} never reached the client"
            assert b"".join(g.payload for g in got if g.kind == "data") == a.data
        for sid, n in self.runtime_data.items():
            if self.paths[sid] == VERSION:
                assert sum(len(g.payload) for g in self.got.get(sid, []) if g.kind == "data") == n

    def teardown(self) -> None:
        """Every answer ends, the runtime's bytes are read and the client opens its window: all arrives."""
        for _ in range(20):
            for sid in sorted(self.local):
                a = self.answers.setdefault(sid, Answer("trailers", grpc.StatusCode.OK, "", b""))
                for _ in range(4):
                    if a.ended:
                        break
                    self._answer_step(sid, a)
                    self.take()
            if self.wire:
                self.core.receive_runtime(self.wire)
                self.wire = b""
                self.take()
            need = sum(n for s, n in self.runtime_data.items() if self.paths[s] == VERSION) + \
                sum(len(a.data) for a in self.answers.values())
            if self.granted < need:
                self.core.receive_client(http2.window_update(0, need - self.granted))
                self.granted = need
                self.take()
            if self._settled():
                break
        stuck = sorted(s for s, a in self.answers.items() if not a.ended)
        assert not stuck, f"the shim's answers on streams {stuck} never ended: no room for their DATA (send_room 0)"
        assert not self.wire and self._settled()
        self.runtime_blocks_arrive_as_encoded_and_in_order()
        self.the_shim_answers_its_streams_first_and_alone()
        self.nothing_the_runtime_sent_is_lost()


TestHpackMachine = HpackMachine.TestCase
TestHpackMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                     phases=[Phase.explicit, Phase.reuse, Phase.generate] if NO_SHRINK else list(Phase),
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                                     report_multiple_bugs=False)
