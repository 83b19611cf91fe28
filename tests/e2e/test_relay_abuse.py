"""One local client must never exhaust the shim (issue 13): each attack against the shim as a
process (``python -m shim serve``, default config, file-descriptor soft limit 1024 as systemd
gives a unit without ``LimitNOFILE``) in front of the session's real containerd 1.6.

While an attack runs, an honest client calls ``Version`` every 50 ms (over one connection,
and every fifth call over a new one). For every attack:

- the shim stays up;
- every honest call succeeds, none slower than ``LATENCY_BOUND_S``;
- the shim's RSS peak stays within ``RSS_BOUND_MIB`` of its RSS before the attack (the bound
  README's "Limits" documents: tens of MiB, not hundreds);
- a new client can connect and call ``Version`` right after the attack.

Attacks are bounded (a few seconds each, a byte or count budget), loopback only:

- ``ping_flood``: PINGs as fast as the socket takes them; the client never reads.
- ``silent_sockets``: 600 connections that never send the preface (the shim's soft limit is
  1024 fds); an honest new client must still get through while they are open.
- ``continuation_flood``: HEADERS then CONTINUATION frames without END_HEADERS, up to 128 MiB
  (reconnecting when the shim closes the connection).
- ``huge_header_blocks``: complete header blocks, each with a distinct 2 MiB ``:path`` (one in
  four Huffman-coded), one stream after the other (reconnecting when the shim closes).
- ``gzip_bomb``: a PullImage (intercepted) whose 256 KiB gzip body inflates to 256 MiB; the
  shim must refuse it with RESOURCE_EXHAUSTED.
- ``data_beyond_window``: 40 intercepted PullImage streams each sent 4 MiB of DATA, ignoring
  the 64 KiB flow-control window (reconnecting when the shim closes the connection).

and, apart (the shim is shutting down, so no honest client): ``test_new_stream_after_goaway``:
after the shim's GOAWAY, a new stream RemoveImage of a pinned image must not reach containerd.

Attacks main fails are ``xfail(strict=True)`` ("issue 13: relay-core"): they flip when the
hardened relay lands. Each test prints its numbers (run with ``-s``).
"""

from __future__ import annotations

import asyncio
import resource
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from tests.support import cri
from tests.support.containerd import Containerd
from tests.support.h2raw import (
    CONTINUATION, DATA, END_STREAM, GOAWAY, HEADERS, PING, REFUSED_STREAM, RST_STREAM, SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE, WINDOW_UPDATE, Frame, RawH2, frame, grpc_message, headers, hpack_int,
    hpack_string, literal, request_block,
)
from tests.support.shim_process import ShimProcess, start_shim

pytestmark = pytest.mark.e2e

VERSION = "/runtime.v1.RuntimeService/Version"
PULL_IMAGE = "/runtime.v1.ImageService/PullImage"
REMOVE_IMAGE = "/runtime.v1.ImageService/RemoveImage"

SHIM_NOFILE = 1024          # systemd's default soft limit for a unit without LimitNOFILE
RSS_BOUND_MIB = 64          # peak RSS growth allowed during one attack
LATENCY_BOUND_S = 2.0       # slowest honest Version call allowed during an attack (a shared, busy CI box)
ATTACK_SECONDS = 4.0        # each attack's time budget
RELAY_CORE = pytest.mark.xfail(strict=True, reason="issue 13: relay-core")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssPeak(threading.Thread):
    """Samples a process's RSS every 10 ms until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return
            self._halt.wait(0.01)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


class Honest(threading.Thread):
    """Version every 50 ms over one channel; every fifth call over a new connection instead."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        request = cri.version_request()
        with grpc.insecure_channel(cri.target(self.path), options=[("grpc.enable_retries", 0)]) as channel:
            stub = channel.unary_unary(VERSION)
            i = 0
            while not self._halt.is_set():
                i += 1
                fresh = i % 5 == 0
                t0 = time.monotonic()
                try:
                    if fresh:
                        res = cri.call(self.path, "Version", request, timeout=10)
                        if not res.ok:
                            raise RuntimeError(f"{res.code.name}: {res.details}")
                    else:
                        stub(request, timeout=10)
                except Exception as e:  # noqa: BLE001  every failure is reported
                    code = e.code().name if isinstance(e, grpc.RpcError) else ""  # type: ignore[attr-defined]
                    self.failures.append(f"{'new' if fresh else 'kept'} connection: {code} {e}"[:300])
                self.latencies.append(time.monotonic() - t0)
                self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# --------------------------------------------------------------------------- attacks

Attack = Callable[[str], list[str]]  # socket path -> problems seen by the attacker itself


def ping_flood(path: str) -> list[str]:
    c = RawH2(path)
    chunk = frame(PING, 0, 0, b"abcdefgh") * 4096
    sent, end = 0, time.monotonic() + ATTACK_SECONDS
    while sent < 5_000_000 and time.monotonic() < end:
        if not c.send(chunk, timeout=max(0.05, end - time.monotonic())):
            break
        sent += 4096
    c.close()
    print(f"  ping_flood: {sent} PINGs written")
    return []


def _connect_unix(path: str, timeout: float) -> socket.socket | str:
    """A connected socket, or why not. A full listen backlog (EAGAIN) is waited out up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
            return s
        except BlockingIOError as e:
            s.close()
            if time.monotonic() > deadline:
                return f"listen backlog full for {timeout} s: {e}"
            time.sleep(0.01)
        except OSError as e:
            s.close()
            return str(e)


def silent_sockets(path: str) -> list[str]:
    socks: list[socket.socket] = []
    problems: list[str] = []
    try:
        for _ in range(600):
            s = _connect_unix(path, 5.0)
            if isinstance(s, str):
                problems.append(f"silent socket {len(socks) + 1} could not connect: {s}")
                break
            socks.append(s)
        time.sleep(0.5)  # let the shim accept them all (the honest client keeps probing meanwhile)
        for attempt in range(3):
            res = cri.call(path, "Version", cri.version_request(), timeout=5)
            if not res.ok:
                problems.append(f"new client with {len(socks)} silent sockets open: {res.code.name}: {res.details}")
        deadline = time.monotonic() + ATTACK_SECONDS - 1
        while time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for s in socks:
            s.close()
    print(f"  silent_sockets: {len(socks)} held")
    return problems


def continuation_flood(path: str) -> list[str]:
    pad = frame(CONTINUATION, 0, 1, literal(b"x-pad", b"a" * 16000)) * 64  # ~1 MiB
    sent, conns, end = 0, 0, time.monotonic() + ATTACK_SECONDS
    while sent < 128 << 20 and time.monotonic() < end and conns < 200:
        c = RawH2(path)
        conns += 1
        ok = c.send(frame(HEADERS, 0, 1, request_block(VERSION)))
        while ok and sent < 128 << 20 and time.monotonic() < end:
            ok = c.send(pad, timeout=max(0.05, end - time.monotonic()))
            if ok:
                sent += len(pad)
        c.close()
    print(f"  continuation_flood: {sent >> 20} MiB of CONTINUATION over {conns} connection(s)")
    return []


_FIVE_BIT = b"012aceiost"  # Huffman codes of 5 bits: 8 of them fill exactly 5 bytes


def _huffman_path(n: int, coded_tail: bytes) -> bytes:
    digits = bytes(_FIVE_BIT[int(d)] for d in f"{n:08d}")
    coded = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(digits) + coded_tail
    return hpack_int(len(coded), 7, 0x80) + coded  # a Huffman-coded string literal


def huge_header_blocks(path: str) -> list[str]:
    raw_tail = b"a" * (2 << 20)
    coded_tail = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(b"aaaaaaaa") * (2 << 20 >> 3)
    base = b"".join(literal(n, v) for n, v in ((b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"),
                                               (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    blocks, conns, end = 0, 0, time.monotonic() + ATTACK_SECONDS
    c = None
    sid = 1
    while blocks < 400 and time.monotonic() < end and conns < 200:
        if c is None:
            c, sid = RawH2(path), 1
            conns += 1
        if blocks % 4 == 3:  # Huffman-coded: the shim must decode 2 MiB to read it
            value = _huffman_path(blocks, coded_tail)
        else:
            value = hpack_string(f"{blocks:08d}".encode() + raw_tail)
        block = base + b"\x00\x05:path" + value
        if not c.send(headers(sid, block, end_stream=True), timeout=max(0.05, end - time.monotonic())):
            c.close()
            c = None
            continue
        blocks += 1
        sid += 2
    if c is not None:
        c.close()
    print(f"  huge_header_blocks: {blocks} blocks with a distinct 2 MiB :path (1 in 4 Huffman-coded) "
          f"over {conns} connection(s)")
    return []


_BOMB: dict[str, bytes] = {}


def gzip_bomb_body(inflated_mib: int = 256) -> bytes:
    """PullImageRequest{image: ImageSpec{image: "a" * N}} gzip-compressed, N about inflated_mib MiB."""
    if "body" not in _BOMB:
        n = inflated_mib << 20
        inner_head = b"\x0a" + cri.varint(n)  # field 1, length-delimited
        head = b"\x0a" + cri.varint(len(inner_head) + n) + inner_head
        z = zlib.compressobj(9, zlib.DEFLATED, 31)
        parts = [z.compress(head)]
        chunk = b"a" * (1 << 20)
        for _ in range(inflated_mib):
            parts.append(z.compress(chunk))
        parts.append(z.flush())
        _BOMB["body"] = b"".join(parts)
    return _BOMB["body"]


def send_with_flow_control(c: RawH2, sid: int, data: bytes, timeout: float) -> Frame | None:
    """DATA within the peer's windows; returns an RST_STREAM/GOAWAY that stopped it, else None."""
    conn_window = stream_window = 65535
    end = time.monotonic() + timeout
    while data and time.monotonic() < end:
        n = min(len(data), conn_window, stream_window, 16384)
        if n > 0:
            last = n == len(data)
            if not c.send(frame(DATA, END_STREAM if last else 0, sid, data[:n])):
                return None
            data, conn_window, stream_window = data[n:], conn_window - n, stream_window - n
            continue
        f = c.read_frame(max(0.01, end - time.monotonic()))
        if f is None:
            return None
        if f.type == SETTINGS and not f.flags & 1:
            for i in range(0, len(f.payload), 6):
                if int.from_bytes(f.payload[i:i + 2], "big") == SETTINGS_INITIAL_WINDOW_SIZE:
                    stream_window += int.from_bytes(f.payload[i + 2:i + 6], "big") - 65535
            c.send(frame(SETTINGS, 1, 0))
        elif f.type == WINDOW_UPDATE:
            inc = int.from_bytes(f.payload[:4], "big") & 0x7FFFFFFF
            if f.stream_id == 0:
                conn_window += inc
            elif f.stream_id == sid:
                stream_window += inc
        elif f.type == GOAWAY or (f.type == RST_STREAM and f.stream_id == sid):
            return f
    return None


def gzip_bomb(path: str) -> list[str]:
    body = grpc_message(gzip_bomb_body(), compressed=True)
    c = RawH2(path, timeout=30)
    c.send(headers(1, request_block(PULL_IMAGE, [(b"grpc-encoding", b"gzip")]), end_stream=False))
    stopped = send_with_flow_control(c, 1, body, timeout=20)
    status = None
    if stopped is None:
        f, _ = c.read_until(lambda f: f.stream_id == 1 and (f.type == RST_STREAM or
                                                            (f.type == HEADERS and f.flags & END_STREAM)), 30)
        if f is not None and f.type == HEADERS:
            status = c.decode_headers(f).get(b"grpc-status")
        stopped = f
    c.close()
    print(f"  gzip_bomb: {len(body) >> 10} KiB gzip inflating to 256 MiB; grpc-status {status!r}, "
          f"stopped by {stopped}")
    if status != b"8":
        return [f"the bomb was not refused with RESOURCE_EXHAUSTED (grpc-status {status!r}, frame {stopped})"]
    return []


def data_beyond_window(path: str) -> list[str]:
    body_head = b"\0" + (15 << 20).to_bytes(4, "big")  # a gRPC message header declaring 15 MiB
    sent, conns, streams, end = 0, 0, 0, time.monotonic() + ATTACK_SECONDS
    c = None
    while streams < 2000 and time.monotonic() < end and conns < 200:
        if c is None:
            c = RawH2(path)
            conns += 1
            sid = 1
        data = frame(DATA, 0, sid, body_head + b"\0" * (16384 - 5)) + frame(DATA, 0, sid, b"\0" * 16384) * 255  # 4 MiB
        ok = c.send(headers(sid, request_block(PULL_IMAGE), end_stream=False) + data,
                    timeout=max(0.05, end - time.monotonic()))
        if not ok:
            c.close()
            c = None
            continue
        sent += len(data)
        streams += 1
        sid += 2
        if sid > 79:  # 40 streams on one connection, then a new connection
            c.close()
            c = None
    if c is not None:
        c.close()
    print(f"  data_beyond_window: {sent >> 20} MiB of DATA on {streams} PullImage stream(s), "
          f"{conns} connection(s), windows ignored")
    return []


# --------------------------------------------------------------------------- the harness


def _soft_nofile() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SHIM_NOFILE, hard), hard))


@pytest.fixture(autouse=True)
def _enough_fds_for_the_attacker() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _shim(containerd: Containerd, tmp_path: Path, settings: dict | None = None) -> ShimProcess:
    return await start_shim(containerd.endpoint, tmp_path, settings or {}, preexec_fn=_soft_nofile)


# issue 13, fixed by relay-core: every attack below breaks a bound on main (measured, main @ ef22f76:
# ping_flood +228 MiB, silent_sockets: new clients UNAVAILABLE, continuation_flood +251 MiB,
# huge_header_blocks +255 MiB, gzip_bomb +1270 MiB, data_beyond_window +163 MiB). Remove an attack
# from this set when the relay passes it (strict: an unexpected pass fails the run).
KNOWN_RELAY_GAPS: set[str] = set()
ATTACKS: list = [
    pytest.param(a, id=a.__name__, marks=[RELAY_CORE] if a.__name__ in KNOWN_RELAY_GAPS else [])
    for a in (ping_flood, silent_sockets, continuation_flood, huge_header_blocks, gzip_bomb, data_beyond_window)
]


@pytest.mark.parametrize("attack", ATTACKS)
async def test_attack_leaves_the_shim_serving_within_bounds(attack: Attack, containerd: Containerd,
                                                            tmp_path: Path) -> None:
    if attack is gzip_bomb:
        await asyncio.to_thread(gzip_bomb_body)  # build it before measuring anything
    shim = await _shim(containerd, tmp_path)
    try:
        warm = [await cri.acall(shim.path, m, r, timeout=10) for m, r in
                (("Version", cri.version_request()), ("ListImages", cri.list_images_request()),
                 ("ImageStatus", cri.image_status_request("example.invalid/warm:up")))]
        assert all(w.ok for w in warm), warm
        baseline = rss_mib(shim.pid)
        peak = RssPeak(shim.pid)
        honest = Honest(shim.path)
        peak.start()
        honest.start()
        t0 = time.monotonic()
        try:
            problems = await asyncio.to_thread(attack, shim.path)
            await asyncio.sleep(0.5)  # honest calls right after the attack too
        finally:
            honest.stop()
            growth = peak.stop() - baseline
        took = time.monotonic() - t0
        alive = shim.proc.poll() is None
        after = await cri.acall(shim.path, "Version", cri.version_request(), timeout=10) if alive else None
        lat = sorted(honest.latencies) or [0.0]
        print(f"\n  {attack.__name__}: {took:.1f} s; RSS {baseline:.0f} MiB before, +{growth:.0f} MiB peak; "
              f"honest Version: {len(lat)} calls, {len(honest.failures)} failed, p50 {statistics.median(lat) * 1000:.0f} ms, "
              f"max {lat[-1] * 1000:.0f} ms")
        assert alive, f"the shim died ({shim.proc.returncode}):\n{shim.logs()[-3000:]}"
        assert not problems, problems
        assert not honest.failures, f"{len(honest.failures)} honest calls failed, first: {honest.failures[:3]}"
        assert lat[-1] <= LATENCY_BOUND_S, f"an honest Version call took {lat[-1]:.2f} s"
        assert growth <= RSS_BOUND_MIB, f"RSS grew {growth:.0f} MiB (bound {RSS_BOUND_MIB})"
        assert after is not None and after.ok, f"a new client after the attack: {after}"
    finally:
        await shim.stop()


@pytest.fixture
def pinned_image(containerd: Containerd, make_image) -> str:
    image = make_image()
    res = cri.call(containerd.socket, "PullImage", cri.pull_image_request(image.ref), timeout=60)
    assert res.ok, res
    return image.ref


def _present(containerd: Containerd, ref: str) -> bool:
    res = cri.call(containerd.socket, "ImageStatus", cri.image_status_request(ref), timeout=10)
    assert res.ok, res
    return cri.decode_image_status_response(res.unwrap()) is not None


@pytest.mark.xfail("new_stream_after_goaway" in KNOWN_RELAY_GAPS, strict=True, reason="issue 13: relay-core")
async def test_new_stream_after_goaway(containerd: Containerd, pinned_image: str, tmp_path: Path) -> None:
    """After the shim's GOAWAY (SIGTERM), a new stream is refused and never reaches the runtime:
    a RemoveImage of a pinned image must leave the image in place."""
    shim = await _shim(containerd, tmp_path, {"pins": {"images": [pinned_image]},
                                              "server": {"shutdown_grace_seconds": 5}})
    try:
        c = RawH2(shim.path)
        # stream 1 stays open (no END_STREAM) so the connection outlives the GOAWAY
        c.send(headers(1, request_block(VERSION), end_stream=False))
        await asyncio.to_thread(c.read_until, lambda f: f.type == SETTINGS, 5)
        shim.terminate()
        goaway, _ = await asyncio.to_thread(c.read_until, lambda f: f.type == GOAWAY, 10)
        assert goaway is not None, "no GOAWAY after SIGTERM"
        last = int.from_bytes(goaway.payload[:4], "big") & 0x7FFFFFFF
        c.send(headers(3, request_block(REMOVE_IMAGE), end_stream=False)
               + frame(DATA, END_STREAM, 3, grpc_message(cri.remove_image_request(pinned_image))))
        answer, seen = await asyncio.to_thread(
            c.read_until, lambda f: f.stream_id == 3 and (f.type == RST_STREAM or f.flags & END_STREAM), 5)
        status = c.decode_headers(answer).get(b"grpc-status") if answer is not None and answer.type == HEADERS else None
        c.send(frame(DATA, END_STREAM, 1, grpc_message(cri.version_request())))  # let stream 1 finish
        c.close()
        print(f"\n  GOAWAY last-stream-id {last}; stream 3 answered with {answer}, grpc-status {status!r}")
        assert _present(containerd, pinned_image), "the pinned image was removed through a stream opened after GOAWAY"
        assert answer is None or answer.type == RST_STREAM and answer.error_code == REFUSED_STREAM or status not in (None, b"0"), \
            f"stream 3 after GOAWAY got {answer} (grpc-status {status!r})"
    finally:
        await shim.stop()
