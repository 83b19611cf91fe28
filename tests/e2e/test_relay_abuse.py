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
import select
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
from shim.process.admin import fetch_status
from tests.support.containerd import Containerd
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.h2raw import (
    CONTINUATION, DATA, END_STREAM, GOAWAY, HEADERS, PING, PREFACE, REFUSED_STREAM, RST_STREAM, SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE, WINDOW_UPDATE, Frame, RawH2, frame, grpc_message, headers, hpack_int,
    hpack_string, literal, request_block,
)
from tests.support.other_uid import NOBODY, require_root, run_as, shared_dir
from tests.support.shim import ShimProcess, start_shim

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
    """Version every 50 ms over one channel; every fifth call over a new connection instead.

    Kubelet-like (``interval=0.3, fresh_every=0``): one connection kept, as kubelet does;
    ``also`` adds calls (method, request) made over it in every round."""

    def __init__(self, path: str, interval: float = 0.05, fresh_every: int = 5,
                 also: tuple[tuple[str, bytes], ...] = ()) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.interval, self.fresh_every, self.also = interval, fresh_every, also
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.calls = 0
        self.first = threading.Event()  # the first round is done (the connection is open)
        self._halt = threading.Event()

    def run(self) -> None:
        request = cri.version_request()
        with grpc.insecure_channel(cri.target(self.path), options=[("grpc.enable_retries", 0)]) as channel:
            calls = [(channel.unary_unary(VERSION), request, "Version")]
            calls += [(channel.unary_unary(cri.method_path(m)), r, m) for m, r in self.also]
            i, started = 0, time.monotonic()
            while not self._halt.is_set():
                i += 1
                fresh = bool(self.fresh_every) and i % self.fresh_every == 0
                for stub, req, name in calls[:1] if fresh else calls:
                    t0 = time.monotonic()
                    try:
                        if fresh:
                            res = cri.call(self.path, "Version", request, timeout=10)
                            if not res.ok:
                                raise RuntimeError(f"{res.code.name}: {res.details}")
                        else:
                            stub(req, timeout=10)
                    except Exception as e:  # noqa: BLE001  every failure is reported
                        code = e.code().name if isinstance(e, grpc.RpcError) else ""  # type: ignore[attr-defined]
                        self.failures.append(f"{name}, {'new' if fresh else 'kept'} connection, sent at "
                                             f"+{t0 - started:.1f} s: {code} {e}"[:300])
                    self.calls += 1
                    self.latencies.append(time.monotonic() - t0)
                self.first.set()
                self._halt.wait(self.interval)

    async def stop(self) -> None:
        """Let the round in progress finish, off the event loop: the loop may be serving the
        runtime of the call in flight (a FakeRuntime in this process). Joined on the loop,
        that call waited out its 10 s deadline (issue 36: the "10 s stalls")."""
        self._halt.set()
        if self.is_alive():
            await asyncio.to_thread(self.join, 30)


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


def send_with_flow_control(c: RawH2, sid: int, data: bytes, timeout: float,
                           seen: list[Frame] | None = None) -> Frame | None:
    """DATA within the peer's windows; returns an RST_STREAM/GOAWAY that stopped it, else None.
    Frames read meanwhile are appended to ``seen``."""
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
        if seen is not None:
            seen.append(f)
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


def _soft_nofile() -> tuple[int, None]:
    """The shim's RLIMIT_NOFILE: soft SHIM_NOFILE (at most the hard limit), hard unchanged."""
    return min(SHIM_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]), None


@pytest.fixture(autouse=True)
def _enough_fds_for_the_attacker() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _shim(containerd: Containerd | str, tmp_path: Path, settings: dict | None = None,
                **kwargs: object) -> ShimProcess:
    endpoint = containerd if isinstance(containerd, str) else containerd.endpoint
    return await start_shim(endpoint, tmp_path, settings or {}, nofile=_soft_nofile(), **kwargs)


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
            # the attacker in a process of its own (as root), as a local attacker is: in a thread here it
            # would share this process's GIL with the honest client, and measure that instead of the shim
            problems = await asyncio.to_thread(run_as, 0, attack, shim.path, timeout=180)
            await asyncio.sleep(0.5)  # honest calls right after the attack too
        finally:
            await honest.stop()
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
        await shim.astop()


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
        await shim.astop()


# --------------------------------------------------------------------------- issue 21: memory and admission
#
# The attacker runs as another local user (nobody, in the socket's group): a process the
# shim does not trust (server.trusted_uids). The honest client is kubelet-like: root, one
# connection, a call every 0.3 s.

LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
LIST_IMAGES = "/runtime.v1.ImageService/ListImages"
IMAGE_STATUS = "/runtime.v1.ImageService/ImageStatus"
KUBELET_INTERVAL_S = 0.3
PINNED = "example.invalid/pinned:1"  # a pin makes ListImages and ImageStatus intercepted
LOCKOUT_CAP = 8                # server.max_connections in the lockout test
KUBELET_P50_BOUND_S = 0.25     # kubelet's calls while another uid churns thousands of connections a second
KUBELET_MAX_BOUND_S = 5.0      # (a 2-core box at load ~17 during development: generous margins)
LOCKOUT_SECONDS = 12.0         # half churning connections, half holding them (> STALL_SECONDS)
STALL_SECONDS = 2              # server.stream_stall_seconds in these tests
MEMORY_RSS_BOUND_MIB = 192     # README "Limits": 3 x server.max_request_buffer_bytes (64 MiB by default)


def _shared_socket_settings(admin: Path, extra: dict | None = None) -> dict:
    server = {"socket_group": str(NOBODY), "admin_socket": str(admin), "stream_stall_seconds": STALL_SECONDS}
    settings = {"server": server, "pins": {"images": [PINNED]}}
    for k, v in (extra or {}).items():
        settings.setdefault(k, {}).update(v)
    return settings


def _busy_looking_connection(path: str, kind: int) -> socket.socket | None:
    """A connection that looks busy at no cost to the attacker, one of five kinds."""
    s = _connect_unix(path, 2.0)
    if isinstance(s, str):
        return None
    s.setblocking(True)
    s.settimeout(2)
    hello = PREFACE + frame(SETTINGS, 0, 0)
    try:
        if kind == 0:  # silent: no preface
            pass
        elif kind == 1:  # an intercepted request whose body never completes
            s.sendall(hello + headers(1, request_block(PULL_IMAGE), end_stream=False)
                      + frame(DATA, 0, 1, b"\0" + (1000).to_bytes(4, "big") + b"x" * 100))
        elif kind == 2:  # a relayed request whose body never comes
            s.sendall(hello + headers(1, request_block(VERSION), end_stream=False))
        else:  # an answer held by a zero flow-control window: relayed (3) or intercepted (4)
            zero = PREFACE + frame(SETTINGS, 0, 0, SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + bytes(4))
            s.sendall(zero + headers(1, request_block(LIST_CONTAINERS if kind == 3 else LIST_IMAGES), end_stream=False)
                      + frame(DATA, END_STREAM, 1, grpc_message(b"")))
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def lock_kubelet_out(path: str, seconds: float, churn: int, hold: int) -> dict[str, int]:
    """(Runs as another uid.) First half of ``seconds``: keep ``churn`` busy-looking connections
    open, reopening each one the shim closes, as fast as it can. Second half: ``hold`` of them
    (the kinds with a request in flight), kept, counting the streams the shim ends."""
    conns: dict[socket.socket, bytearray] = {}
    opened = closed = failed = ended = 0
    half = time.monotonic() + seconds / 2
    kinds = [1, 4, 2, 3]

    def pump(until: float, target: int, kind_of) -> None:
        nonlocal opened, closed, failed, ended
        while time.monotonic() < until:
            while len(conns) < target and time.monotonic() < until:
                s = _busy_looking_connection(path, kind_of(opened))
                if s is None:
                    failed += 1
                    time.sleep(0.01)
                    continue
                conns[s] = bytearray()
                opened += 1
            ready, _, _ = select.select(list(conns), [], [], 0.05)
            for s in ready:
                try:
                    data = s.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    del conns[s]
                    s.close()
                    closed += 1
                    continue
                buf = conns[s] + data
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    n, ftype, flags, sid = int.from_bytes(buf[:3], "big"), buf[3], buf[4], buf[8]
                    if sid == 1 and (ftype == RST_STREAM or (ftype == HEADERS and flags & END_STREAM)):
                        ended += 1
                    del buf[:9 + n]
                conns[s] = buf

    pump(half, churn, lambda i: i % 5)
    for s in conns:
        s.close()
    conns.clear()
    ended = 0
    pump(half + seconds / 2, hold, lambda i: kinds[i % len(kinds)])
    for s in conns:
        s.close()
    return {"opened": opened, "closed_by_shim": closed, "connect_failed": failed, "streams_ended_by_shim": ended}


async def _relay_status(admin: Path) -> dict:
    return (await asyncio.to_thread(fetch_status, str(admin)))["relay"]


async def _back_to_idle(admin: Path, connections: int, timeout: float = 10.0) -> dict:
    """The relay's status once only ``connections`` (the honest ones) are left and nothing is held."""
    deadline = time.monotonic() + timeout
    while True:
        st = await _relay_status(admin)
        idle = (st["connections"], st["intercepted_calls"], st["request_buffer_bytes"]) == (connections, 0, 0)
        if idle or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.1)


async def test_another_uid_cannot_lock_kubelet_out(containerd: Containerd, tmp_path: Path) -> None:
    """With server.max_connections 8, another uid holding and churning busy-looking connections
    (no preface, half-sent bodies, answers held by a zero window) cannot fail or slow kubelet's calls.
    main @ 48be281 (no peer admission): 31 of 41 kubelet Version calls failed, every one while it churned."""
    require_root()
    with shared_dir() as d:
        admin = d / "admin.sock"
        shim = await _shim(containerd, tmp_path, _shared_socket_settings(admin, {"server": {"max_connections": LOCKOUT_CAP}}),
                           listen_path=f"{d}/shim.sock")
        kubelet = Honest(shim.path, interval=KUBELET_INTERVAL_S, fresh_every=0)
        try:
            baseline = rss_mib(shim.pid)
            peak = RssPeak(shim.pid)
            peak.start()
            kubelet.start()
            assert await asyncio.to_thread(kubelet.first.wait, 10), "kubelet's first call did not finish"
            attack = await asyncio.to_thread(run_as, NOBODY, lock_kubelet_out, shim.path, LOCKOUT_SECONDS,
                                             2 * LOCKOUT_CAP, LOCKOUT_CAP // 2, timeout=LOCKOUT_SECONDS + 30)
            await kubelet.stop()
            growth = peak.stop() - baseline
            lat = sorted(kubelet.latencies)
            print(f"\n  lockout: attacker {attack}; kubelet: {kubelet.calls} calls, {len(kubelet.failures)} failed, "
                  f"p50 {statistics.median(lat) * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms; RSS +{growth:.0f} MiB")
            assert shim.proc.poll() is None, f"the shim died:\n{shim.logs()[-3000:]}"
            assert attack["opened"] > 2 * LOCKOUT_CAP and attack["closed_by_shim"] > 0, attack  # it did its worst
            assert not kubelet.failures, f"{len(kubelet.failures)} of {kubelet.calls} failed: {kubelet.failures[:3]}"
            assert kubelet.calls >= LOCKOUT_SECONDS / KUBELET_INTERVAL_S / 2
            assert statistics.median(lat) <= KUBELET_P50_BOUND_S and lat[-1] <= KUBELET_MAX_BOUND_S, \
                f"kubelet's calls: p50 {statistics.median(lat):.2f} s, max {lat[-1]:.2f} s"
            assert growth <= RSS_BOUND_MIB, f"RSS grew {growth:.0f} MiB (bound {RSS_BOUND_MIB})"
            # held: its intercepted calls (body never complete, answer on a zero window) end after the stall timeout
            assert attack["streams_ended_by_shim"] >= 2, attack
            assert "ended an intercepted call: the client opens no flow-control window" in shim.logs()
            st = await _back_to_idle(admin, 0)
            assert (st["connections"], st["intercepted_calls"], st["request_buffer_bytes"]) == (0, 0, 0), st
        finally:
            await kubelet.stop()  # idempotent: a failed test leaves no thread calling
            await shim.astop()


def queue_big_pulls(path: str, n: int, size: int, hold_s: float) -> dict[str, int]:
    """(Runs as any uid.) ``n`` PullImage requests of ``size`` bytes on one connection, within
    flow control, then hold the connection ``hold_s``; returns the grpc-status counts."""
    c = RawH2(path, timeout=30)
    seen: list[Frame] = []
    for i in range(n):
        sid = 2 * i + 1
        body = grpc_message(cri.pull_image_request(f"example.invalid/big{i}:1", annotations={"a": "x" * size}))
        if not c.send(headers(sid, request_block(PULL_IMAGE), end_stream=False)):
            break
        send_with_flow_control(c, sid, body, timeout=60, seen=seen)
    end = time.monotonic() + hold_s
    while (left := end - time.monotonic()) > 0:
        f = c.read_frame(left)
        if f is None and c.closed:
            break
        if f is not None:
            seen.append(f)
    counts: dict[str, int] = {}
    for f in seen:
        if f.type == HEADERS and f.flags & END_STREAM:
            code = c.decode_headers(f).get(b"grpc-status", b"?").decode()
            counts[code] = counts.get(code, 0) + 1
    c.close()
    counts["answered"] = sum(counts.values())
    return counts


@pytest.mark.parametrize("attacker", [0, NOBODY], ids=["root", "nobody"])
async def test_queued_pull_requests_stay_within_the_memory_bound(attacker: int, tmp_path: Path) -> None:
    """pulls.max_parallel 2 and pulls that do not finish (one slot for nobody, two for root; with
    a cap of 1 nobody's pulls would be refused at once: no slot for untrusted peers): one connection queues 40 PullImage
    requests of 15 MiB, then 40 just under PullImage's 4 MiB limit. RSS stays within the README's
    bound, kubelet's calls keep working, and everything is given back afterwards.
    main @ 48be281: the 15 MiB requests were all taken in, RSS +1,230 MiB (as root); here +134 MiB."""
    require_root()
    release = asyncio.Event()

    async def slow_pull(request: bytes, context: object) -> bytes:
        await release.wait()
        return b"\x0a\x04done"

    with shared_dir() as d:
        admin = d / "admin.sock"
        rt = await FakeRuntime(socket_in(str(d), "rt.sock")).start()
        rt.unary[VERSION] = cri.version_request()
        rt.unary[PULL_IMAGE] = slow_pull
        shim = await _shim(rt.endpoint, tmp_path, _shared_socket_settings(
            admin, {"pulls": {"max_parallel": 2, "progress_interval_seconds": 0}}), listen_path=f"{d}/shim.sock")
        also = (("ImageStatus", cri.image_status_request(PINNED)),)
        kubelet = Honest(shim.path, interval=KUBELET_INTERVAL_S, fresh_every=0, also=also)
        try:
            warm = [await cri.acall(shim.path, m, r, timeout=10) for m, r in (("Version", cri.version_request()), *also)]
            assert all(w.ok for w in warm), warm
            baseline = rss_mib(shim.pid)
            peak = RssPeak(shim.pid)
            peak.start()
            kubelet.start()
            big = await asyncio.to_thread(run_as, attacker, queue_big_pulls, shim.path, 40, 15 << 20, 0.0, timeout=300)
            near = await asyncio.to_thread(run_as, attacker, queue_big_pulls, shim.path, 40, (4 << 20) - (64 << 10),
                                           3.0, timeout=300)
            await kubelet.stop()
            growth = peak.stop() - baseline
            release.set()
            lat = sorted(kubelet.latencies)
            print(f"\n  memory ({'root' if attacker == 0 else 'nobody'}): RSS {baseline:.0f} MiB, +{growth:.0f} MiB peak; "
                  f"15 MiB requests {big}; 4 MiB requests {near}; kubelet: {kubelet.calls} calls, "
                  f"{len(kubelet.failures)} failed, max {lat[-1] * 1000:.0f} ms")
            assert shim.proc.poll() is None, f"the shim died:\n{shim.logs()[-3000:]}"
            assert big == {"8": 40, "answered": 40}, big  # RESOURCE_EXHAUSTED, each on its declared length
            assert near.get("8", 0) > 0 and near["answered"] < 40, near  # some queued, the rest refused
            assert growth <= MEMORY_RSS_BOUND_MIB, f"RSS grew {growth:.0f} MiB (bound {MEMORY_RSS_BOUND_MIB})"
            assert not kubelet.failures, (f"{len(kubelet.failures)} of {kubelet.calls} failed: {kubelet.failures[:3]}\n"
                                          f"the shim's log:\n{shim.logs()[-3000:]}")
            assert lat[-1] <= LATENCY_BOUND_S, f"a kubelet call took {lat[-1]:.2f} s"
            st = await _back_to_idle(admin, 0)
            assert (st["connections"], st["intercepted_calls"], st["request_buffer_bytes"]) == (0, 0, 0), st
        finally:
            release.set()
            await kubelet.stop()  # idempotent: a failed test leaves no thread calling
            await shim.astop()
            await rt.stop()
