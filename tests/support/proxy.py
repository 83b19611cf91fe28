"""A counting, throttling HTTP/1.1 reverse proxy for a registry.

containerd is pointed at the proxy, so every manifest and blob request it
makes is seen here.  The proxy counts

* manifest requests (GET/HEAD ``/v2/<name>/manifests/<ref>``), per image;
* blob requests (GET ``/v2/<name>/blobs/<digest>``) and blob bytes served;
* the maximum number of distinct images with a request in flight at once.

An *image* is ``(repository, tag)``.  A request by digest is attributed to
the tag whose manifest had that digest (learned from ``Docker-Content-Digest``
on earlier tag requests); a blob GET is attributed to the image whose
manifest (served through this proxy) listed the blob, else to the last image
of that repository seen, else to ``(repository, "?")``.

Blob bodies can be throttled (bytes per second per connection, and/or a link
rate shared by all blob bodies, like a node's network link), blob GETs can be
held until released, a repository can be made to hang (its manifest requests
never answered, or its blob bodies stopped mid-way, while the connection stays
open), and errors can be injected.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

_MANIFEST_RE = re.compile(r"^/v2/(?P<repo>.+)/manifests/(?P<ref>[^/?]+)(?:\?.*)?$")
_BLOB_RE = re.compile(r"^/v2/(?P<repo>.+)/blobs/(?P<digest>[a-z0-9]+:[a-fA-F0-9]+)(?:\?.*)?$")

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
}

ImageKey = tuple[str, str]  # (repository, tag or digest)


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    kind: str  # "manifest", "blob", "other"
    image: ImageKey | None
    status: int
    bytes: int
    start: float
    end: float


@dataclass
class ProxyStats:
    """A snapshot of the proxy counters (see :meth:`CountingProxy.stats`)."""

    manifest_requests: int = 0
    manifest_gets: int = 0
    manifest_heads: int = 0
    blob_requests: int = 0  # blob GETs
    blob_heads: int = 0
    blob_bytes: int = 0
    other_requests: int = 0
    errors_injected: int = 0
    max_concurrent_images: int = 0
    max_concurrent_repositories: int = 0
    max_inflight_blob_gets: int = 0
    inflight_images: int = 0
    inflight_blob_gets: int = 0
    manifests_by_image: Counter[ImageKey] = field(default_factory=Counter)
    blob_gets_by_image: Counter[ImageKey] = field(default_factory=Counter)

    def manifest_requests_for(self, repository: str, ref: str) -> int:
        return self.manifests_by_image[(repository, ref)]

    def blob_requests_for(self, repository: str, ref: str) -> int:
        return self.blob_gets_by_image[(repository, ref)]


class CountingProxy:
    """Threaded reverse proxy from ``127.0.0.1:<port>`` to ``upstream`` (host:port)."""

    def __init__(self, upstream: str, *, port: int = 0, upstream_timeout: float = 60.0) -> None:
        self.upstream = upstream
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stats = ProxyStats()
        self._records: list[RequestRecord] = []
        self._active_images: Counter[ImageKey] = Counter()
        self._digest_to_tag: dict[tuple[str, str], str] = {}
        self._blob_to_image: dict[tuple[str, str], ImageKey] = {}
        self._last_image: dict[str, ImageKey] = {}
        self._faults: dict[str, list[int]] = {"manifest": [], "blob": []}
        self._blob_gate = threading.Event()
        self._blob_gate.set()
        #: Blob body rate limit in bytes/s per connection (``None`` = unlimited).
        self.throttle_bps: int | None = None
        #: Blob body rate limit in bytes/s shared by all connections (``None`` = unlimited).
        self.link_bps: int | None = None
        self._link_lock = threading.Lock()
        self._link_free_at = 0.0
        #: Extra delay (seconds) before forwarding each manifest request.
        self.manifest_delay: float = 0.0
        #: How long a kept-alive client connection waits for its next request (``None``: for ever).
        #: containerd 1.6 makes a new HTTP transport per pull, so thousands of quickly failing pulls
        #: leave as many idle connections (a thread and two fds each here) for its 90 s idle timeout.
        self.idle_seconds: float | None = None
        #: repository -> where it hangs: ("manifest", 0) or ("blob", bytes sent first).
        self._hangs: dict[str, tuple[str, int]] = {}
        self._unhung = threading.Event()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.proxy = self
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT`` — use as the registry part of image refs."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> CountingProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release_blobs()
        self.unhang()
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- controls ----------------------------------------------------------

    def reset(self) -> None:
        """Zero all counters and the request log (in-flight tracking is kept)."""
        with self._lock:
            inflight = self._stats.inflight_images
            blobs = self._stats.inflight_blob_gets
            self._stats = ProxyStats(
                inflight_images=inflight,
                inflight_blob_gets=blobs,
                max_concurrent_images=inflight,
                max_concurrent_repositories=len({k[0] for k in self._active_images}),
                max_inflight_blob_gets=blobs,
            )
            self._records.clear()
            self._faults = {"manifest": [], "blob": []}

    def set_throttle(self, bytes_per_second: int | None) -> None:
        self.throttle_bps = bytes_per_second

    def set_link_throttle(self, bytes_per_second: int | None) -> None:
        """Share ``bytes_per_second`` among all blob bodies being sent (``None``: off)."""
        self.link_bps = bytes_per_second

    def _link_reserve(self, nbytes: int, bps: int) -> float:
        """Book ``nbytes`` on the shared link (FIFO); returns when they are through."""
        with self._link_lock:
            now = time.monotonic()
            start = max(now, self._link_free_at)
            self._link_free_at = start + nbytes / bps
            return self._link_free_at

    @contextlib.contextmanager
    def throttled(self, bytes_per_second: int) -> Iterator[None]:
        old = self.throttle_bps
        self.throttle_bps = bytes_per_second
        try:
            yield
        finally:
            self.throttle_bps = old

    def hold_blobs(self) -> None:
        """Make blob GETs wait (before contacting upstream) until :meth:`release_blobs`."""
        self._blob_gate.clear()

    def release_blobs(self) -> None:
        self._blob_gate.set()

    def hang(self, repository: str, *, manifest: bool = False, blob_after: int | None = None) -> None:
        """Make ``repository`` hang like a broken registry that keeps the connection open:
        ``manifest``: its manifest requests (HEAD and GET) are never answered; ``blob_after``:
        each blob body stops after that many bytes. Until :meth:`unhang` (or :meth:`stop`)."""
        assert manifest != (blob_after is not None), "hang either the manifest or the blobs"
        self._unhung.clear()
        with self._lock:
            self._hangs[repository] = ("manifest", 0) if manifest else ("blob", blob_after or 0)

    def unhang(self) -> None:
        """Every hanging request gives up (its connection is closed); nothing hangs any more."""
        with self._lock:
            self._hangs.clear()
        self._unhung.set()

    def _hang_for(self, kind: str, path: str) -> int | None:
        """Bytes to send before hanging for this request, or None (no hang)."""
        m = (_MANIFEST_RE if kind == "manifest" else _BLOB_RE).match(path)
        with self._lock:
            hang = self._hangs.get(m["repo"]) if m else None
        return hang[1] if hang is not None and hang[0] == kind else None

    def _hang_now(self) -> None:
        self._unhung.wait(600)
        raise ConnectionResetError("hang ended")

    def clear_faults(self) -> None:
        with self._lock:
            self._faults = {"manifest": [], "blob": []}

    def restore_defaults(self) -> None:
        """No throttle, no manifest delay, blobs released, no pending faults."""
        self.throttle_bps = None
        self.link_bps = None
        self.manifest_delay = 0.0
        self.release_blobs()
        self.unhang()
        self.clear_faults()

    def fail_next(self, kind: str, count: int = 1, status: int = 503) -> None:
        """Answer the next ``count`` ``kind`` ("manifest" or "blob") requests with ``status``."""
        with self._lock:
            self._faults[kind].extend([status] * count)

    # -- observation ---------------------------------------------------------

    def stats(self) -> ProxyStats:
        """A consistent copy of the counters."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> ProxyStats:
        return ProxyStats(
            **{k: (Counter(v) if isinstance(v, Counter) else v) for k, v in self._stats.__dict__.items()}
        )

    def records(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def wait_until(self, predicate: Callable[[ProxyStats], bool], timeout: float = 10.0) -> ProxyStats:
        """Block until ``predicate(stats)`` holds; raise ``TimeoutError`` otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                snap = self._snapshot()
                if predicate(snap):
                    return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"proxy condition not met within {timeout}s: {snap}")
                self._cond.wait(left)

    # -- bookkeeping used by the handler -----------------------------------

    def _classify(self, method: str, path: str) -> tuple[str, ImageKey | None, str | None]:
        m = _MANIFEST_RE.match(path)
        if m:
            repo, ref = m["repo"], m["ref"]
            with self._lock:
                if ":" in ref:
                    ref = self._digest_to_tag.get((repo, ref), ref)
            return "manifest", (repo, ref), None
        m = _BLOB_RE.match(path)
        if m and method in ("GET", "HEAD"):
            repo, digest = m["repo"], m["digest"]
            with self._lock:
                image = self._blob_to_image.get((repo, digest)) or self._last_image.get(repo) or (repo, "?")
            return "blob", image, digest
        return "other", None, None

    def _begin(self, method: str, kind: str, image: ImageKey | None) -> int | None:
        """Count the start of a request; returns an injected status or None."""
        with self._cond:
            s = self._stats
            if kind == "manifest":
                s.manifest_requests += 1
                if method == "HEAD":
                    s.manifest_heads += 1
                else:
                    s.manifest_gets += 1
                assert image is not None
                s.manifests_by_image[image] += 1
                self._last_image[image[0]] = image
            elif kind == "blob":
                if method == "GET":
                    s.blob_requests += 1
                    assert image is not None
                    s.blob_gets_by_image[image] += 1
                    s.inflight_blob_gets += 1
                    s.max_inflight_blob_gets = max(s.max_inflight_blob_gets, s.inflight_blob_gets)
                else:
                    s.blob_heads += 1
            else:
                s.other_requests += 1
            if image is not None:
                self._active_images[image] += 1
                s.inflight_images = len(self._active_images)
                s.max_concurrent_images = max(s.max_concurrent_images, s.inflight_images)
                repos = len({k[0] for k in self._active_images})
                s.max_concurrent_repositories = max(s.max_concurrent_repositories, repos)
            fault = None
            if kind in self._faults and self._faults[kind]:
                fault = self._faults[kind].pop(0)
                s.errors_injected += 1
            self._cond.notify_all()
            return fault

    def _end(self, record: RequestRecord) -> None:
        with self._cond:
            s = self._stats
            if record.kind == "blob" and record.method == "GET":
                s.inflight_blob_gets -= 1
                s.blob_bytes += record.bytes
            if record.image is not None:
                self._active_images[record.image] -= 1
                if self._active_images[record.image] <= 0:
                    del self._active_images[record.image]
                s.inflight_images = len(self._active_images)
            if len(self._records) < 200_000:
                self._records.append(record)
            self._cond.notify_all()

    def _learn_manifest(self, image: ImageKey, headers: http.client.HTTPMessage, body: bytes | None) -> None:
        repo, ref = image
        digest = headers.get("Docker-Content-Digest")
        with self._lock:
            if digest and ":" not in ref:
                self._digest_to_tag[(repo, digest)] = ref
            if body:
                try:
                    doc = json.loads(body)
                except ValueError:
                    return
                if not isinstance(doc, dict):
                    return
                descs = [doc.get("config")] + list(doc.get("layers") or [])
                for d in descs:
                    if isinstance(d, dict) and isinstance(d.get("digest"), str):
                        self._blob_to_image[(repo, d["digest"])] = image


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: CountingProxy

    def handle_error(self, request: object, client_address: object) -> None:
        """A client dropping an idle keep-alive connection is normal: no traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence stderr
        pass

    def handle_one_request(self) -> None:
        idle = self.server.proxy.idle_seconds
        if idle is not None:
            self.connection.settimeout(idle)  # waiting for the request line; parse_request lifts it
        super().handle_one_request()

    def parse_request(self) -> bool:
        if self.server.proxy.idle_seconds is not None:
            self.connection.settimeout(None)
        return super().parse_request()

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def finish(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        super().finish()

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _send_simple(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _proxy(self) -> None:
        proxy = self.server.proxy
        method, path = self.command, self.path
        body = self._read_body()
        kind, image, _digest = proxy._classify(method, path)
        start = time.monotonic()
        status, sent = 0, 0
        fault = proxy._begin(method, kind, image)
        try:
            if fault is not None:
                status = fault
                self._send_simple(fault, b'{"errors":[{"code":"UNAVAILABLE","message":"injected by test proxy"}]}')
                return
            if kind == "manifest" and proxy.manifest_delay:
                time.sleep(proxy.manifest_delay)
            if kind == "manifest" and proxy._hang_for(kind, path) is not None:
                proxy._hang_now()
            if kind == "blob" and method == "GET":
                proxy._blob_gate.wait(120)
            status, sent = self._forward(method, path, body, kind, image)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            # Client went away mid-response (e.g. a cancelled pull): drop upstream too.
            if self._upstream is not None:
                self._upstream.close()
                self._upstream = None
            self.close_connection = True
        finally:
            proxy._end(RequestRecord(method, path, kind, image, status, sent, start, time.monotonic()))

    def _forward(
        self, method: str, path: str, body: bytes | None, kind: str, image: ImageKey | None
    ) -> tuple[int, int]:
        proxy = self.server.proxy
        # A header sent several times (containers/image, so CRI-O, sends one Accept per media
        # type) is forwarded once with its values comma-joined, which means the same (RFC 9110).
        headers: dict[str, str] = {}
        for k, v in self.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                headers[k] = f"{headers[k]}, {v}" if k in headers else v
        if body is not None:
            headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(proxy.upstream, timeout=proxy.upstream_timeout)
            try:
                self._upstream.request(method, path, body=body, headers=headers)
                resp = self._upstream.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest) as exc:
                self._upstream.close()
                self._upstream = None
                if attempt or isinstance(exc, ConnectionRefusedError):
                    # Upstream registry is down: answer like a gateway would.
                    self._send_simple(502, b'{"errors":[{"code":"UNAVAILABLE","message":"upstream down"}]}')
                    return 502, 0
        length = resp.getheader("Content-Length")
        chunked = length is None and method != "HEAD" and resp.status not in (204, 304)
        payload: bytes | None = None
        if chunked or (kind == "manifest" and method == "GET"):
            payload = resp.read()
            length = str(len(payload))
        if kind == "manifest" and image is not None and 200 <= resp.status < 300:
            proxy._learn_manifest(image, resp.headers, payload if method == "GET" else None)
        self.send_response(resp.status, resp.reason)
        for k, v in resp.headers.items():
            if k.lower() in _HOP_BY_HOP or k.lower() == "content-length":
                continue
            self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", length)
        if resp.will_close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        sent = 0
        if method == "HEAD":
            resp.read()
        elif payload is not None:
            self.wfile.write(payload)
            sent = len(payload)
        else:
            throttle = kind == "blob" and method == "GET"
            sent = self._stream(resp, throttle, proxy._hang_for(kind, path) if throttle else None)
        if resp.will_close:
            self._upstream.close()
            self._upstream = None
        return resp.status, sent

    def _stream(self, resp: http.client.HTTPResponse, throttle: bool, hang_after: int | None = None) -> int:
        proxy = self.server.proxy
        sent = 0
        t0 = time.monotonic()
        while True:
            bps = proxy.throttle_bps if throttle else None
            link = proxy.link_bps if throttle else None
            chunk_size = min([65536, *(max(1024, r // 20) for r in (bps, link) if r)])
            if hang_after is not None:
                chunk_size = min(chunk_size, hang_after - sent)
                if chunk_size <= 0:
                    self.wfile.flush()
                    proxy._hang_now()
            chunk = resp.read(chunk_size)
            if not chunk:
                break
            if link:
                wait = proxy._link_reserve(len(chunk), link) - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            self.wfile.write(chunk)
            sent += len(chunk)
            bps = proxy.throttle_bps if throttle else None
            if bps:
                ahead = sent / bps - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        self.wfile.flush()
        return sent
