"""`cri-shim status`: a small admin server on ``server.admin_socket`` and its client.

The server speaks just enough HTTP/1.1 on a unix socket (mode 0600: root only, like
the CRI socket's data it reveals) from the shim's asyncio loop: ``GET /status``
returns one JSON document, then the connection closes. The document holds the
upstream's state, the pull queue and in-flight pulls with their waiters
(``PullScheduler.snapshot()``) and one entry per registered status source
(``App.status_sources``: name -> callable returning a JSON-able dict; image sets
register theirs). Nothing in it is a credential: pull keys hold hashes of auth, and
sources must follow the same rule.

The client prints it for a person, or as JSON with ``--json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

from ..observability import logs
from .unixsock import StartupError, claim

if TYPE_CHECKING:
    from .app import App

_log = logs.get("status")

StatusSource = Callable[[], dict[str, Any]]
_MAX_REQUEST_HEAD = 8192
_READ_TIMEOUT = 5.0


# --------------------------------------------------------------------------- collecting


def collect(app: "App", started_at: float) -> dict[str, Any]:
    """The status document of a running shim."""
    from ..observability.tracing import shim_version

    cfg = app.cfg
    pulls = app.scheduler.snapshot()
    progress = getattr(app, "progress", None)
    for row in pulls["in_flight"]:
        view = progress.view(int(row["id"])) if progress is not None else None  # type: ignore[call-overload]
        if view is not None:
            row["progress"] = view
    out: dict[str, Any] = {
        "version": shim_version(),
        "pid": os.getpid(),
        "uptime_seconds": round(time.monotonic() - started_at, 1),
        "upstream": {"target": app.upstream.target, "state": app.upstream.state},
        "pulls": {"max_parallel": cfg.pulls.max_parallel, "dedup": cfg.pulls.dedup,
                  "progress_interval_seconds": cfg.pulls.progress_interval_seconds,
                  "stall_timeout_seconds": cfg.pulls.stall_timeout_seconds,
                  "stall_min_bytes_per_second": cfg.pulls.stall_min_bytes_per_second, **pulls},
        "tracing": dict(app.tracing.description) if app.tracing.enabled else {"exporter": "off"},
    }
    for name, source in list(app.status_sources.items()):
        try:
            out[name] = source()
        except Exception as e:  # a broken source must not hide the rest
            logs.log(_log, logging.WARNING, "status source failed", source=name, error=type(e).__name__)
            out[name] = {"error": f"status source failed: {type(e).__name__}"}
    return out


# --------------------------------------------------------------------------- server


class AdminServer:
    """Serves ``GET /status`` on a unix socket (mode 0600) from the running loop."""

    def __init__(self, path: str, collect: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._collect = collect
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> bool:
        """Bind and serve. Returns False (logged) if the socket cannot be had: status is not
        worth failing the CRI path for."""
        try:
            claim(self.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # no window in which the socket is world-connectable
            try:
                sock.bind(self.path)
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        except (OSError, StartupError) as e:
            logs.log(_log, logging.ERROR, "admin socket unavailable; `cri-shim status` will not work",
                     path=self.path, error=str(e))
            return False
        return True

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                status, body = 400, {"error": "bad request"}
            elif parts[0] != "GET":
                status, body = 405, {"error": "only GET is served"}
            elif parts[1].split("?", 1)[0] != "/status":
                status, body = 404, {"error": "not found; try GET /status"}
            else:
                status, body = 200, self._collect()
            _respond(writer, status, body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:
            _log.error("admin request failed", exc_info=True)
            with contextlib.suppress(Exception):
                _respond(writer, 500, {"error": "internal error"})
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}


def _respond(writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body, indent=1, sort_keys=False).encode() + b"\n"
    writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)


# --------------------------------------------------------------------------- client


class StatusError(Exception):
    """The admin socket could not be asked; the message says why, for the operator."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def fetch_status(admin_socket: str, timeout: float = 10.0) -> dict[str, Any]:
    conn = _UnixConnection(admin_socket, timeout)
    try:
        conn.request("GET", "/status")
        resp = conn.getresponse()
        body = resp.read()
    except FileNotFoundError:
        raise StatusError(f"no admin socket at {admin_socket}: is cri-shim running, and is "
                          f"server.admin_socket set to this path? (--admin-socket)") from None
    except PermissionError:
        raise StatusError(f"permission denied on {admin_socket}: the admin socket is mode 0600; "
                          f"run as the user the shim runs as (usually root)") from None
    except ConnectionRefusedError:
        raise StatusError(f"nothing is listening on {admin_socket} (a stale socket: is cri-shim running?)") from None
    except (OSError, http.client.HTTPException) as e:
        raise StatusError(f"cannot read status from {admin_socket}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise StatusError(f"{admin_socket} answered HTTP {resp.status}: {body[:200]!r}")
    try:
        return json.loads(body)
    except ValueError:
        raise StatusError(f"{admin_socket} answered something that is not JSON") from None


def print_status(admin_socket: str, as_json: bool = False, out: TextIO | None = None) -> int:
    """`cri-shim status`: 0 on success, 1 (with a message on stderr) if the shim cannot be asked."""
    out = out or sys.stdout
    try:
        doc = fetch_status(admin_socket)
    except StatusError as e:
        print(f"cri-shim: {e}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(render(doc))
    return 0


def watch_status(admin_socket: str, interval: float = 1.0, as_json: bool = False, out: TextIO | None = None,
                 count: int | None = None) -> int:
    """`cri-shim status --watch`: redraw every ``interval`` seconds until interrupted (or ``count`` times).

    On a terminal the screen is cleared before each view; otherwise views are separated
    by a blank line (for logs). With ``--json``, one JSON document per line.
    """
    out = out or sys.stdout
    clear = out.isatty() and not as_json
    shown = 0
    try:
        while count is None or shown < count:
            try:
                doc = fetch_status(admin_socket)
            except StatusError as e:
                text = f"cri-shim: {e}\n"
            else:
                text = json.dumps(doc) + "\n" if as_json else render(doc)
            if clear:
                out.write("\x1b[H\x1b[2J")
            elif shown and not as_json:
                out.write("\n")
            out.write(time.strftime("%H:%M:%S ") + text if not as_json else text)
            out.flush()
            shown += 1
            if count is None or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0


# --------------------------------------------------------------------------- rendering


def _secs(v: Any) -> str:
    try:
        s = float(v)
    except (TypeError, ValueError):
        return str(v)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _pull_line(p: dict[str, Any]) -> str:
    parts = [str(p.get("image", "?"))]
    if p.get("handler"):
        parts.append(f"handler={p['handler']}")
    if p.get("priority") and p["priority"] != "foreground":
        parts.append(f"[{p['priority']}]")
    waiters = p.get("waiters", 0)
    parts.append(f"{waiters} waiting" if waiters != 1 else "1 waiting")
    if "running_seconds" in p:
        parts.append(f"running {_secs(p['running_seconds'])}")
        parts.append(f"(queued {_secs(p.get('queued_seconds', 0))})")
    else:
        parts.append(f"queued {_secs(p.get('queued_seconds', 0))}")
    return "  ".join(parts)


BAR_WIDTH = 24


def progress_line(pr: dict[str, Any]) -> str:
    """``[#########...............]  38%  9.1/24.0 MiB  1/3 layers  3.9 MiB/s  ETA 4s`` (or the phase and why)."""
    from ..pulls.progress import human_bytes

    phase = pr.get("phase", "unknown")
    if "bytes_total" not in pr:
        return f"[{'?' * BAR_WIDTH}]  {phase}: {pr.get('reason', '')}".rstrip(": ")
    done, total = int(pr.get("bytes_done") or 0), int(pr.get("bytes_total") or 0)
    frac = done / total if total else 1.0
    filled = int(round(frac * BAR_WIDTH))
    parts = [f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * frac:3.0f}%",
             f"{human_bytes(done)} / {human_bytes(total)}",
             f"{pr.get('layers_done', 0)}/{pr.get('layers_total', 0)} layers"]
    if phase == "unpacking":
        parts.append("unpacking")
    else:
        rate = pr.get("bytes_per_second")
        parts.append("- /s" if rate is None else f"{human_bytes(rate)}/s")
        eta = pr.get("eta_seconds")
        parts.append("ETA -" if eta is None else f"ETA {_secs(eta)}")
    return "  ".join(parts)


def _generic(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines += _generic(v, indent + 1)
            else:
                lines.append(f"{pad}{k}: {_scalar(v)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, dict) and all(not isinstance(v, (dict, list)) for v in item.values()):
                lines.append(pad + "- " + "  ".join(f"{k}={_scalar(v)}" for k, v in item.items()))
            elif isinstance(item, (dict, list)):
                lines.append(pad + "-")
                lines += _generic(item, indent + 1)
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    return [f"{pad}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if v is None or v == [] or v == {}:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """The status document for a person."""
    lines = [f"cri-shim {doc.get('version', '?')}  pid {doc.get('pid', '?')}  up {_secs(doc.get('uptime_seconds', 0))}"]
    up = doc.get("upstream", {})
    lines.append(f"upstream   {up.get('target', '?')}  {up.get('state', '?')}")
    pulls = doc.get("pulls", {})
    running, queued = pulls.get("in_flight", []), pulls.get("queued", [])
    cap = pulls.get("max_parallel", 0)
    lines.append(f"pulls      {len(running)} running, {len(queued)} queued  "
                 f"(max_parallel {cap or 'unlimited'}, collapse {'on' if pulls.get('dedup', True) else 'off'})")
    for label, rows in (("running", running), ("queued", queued)):
        for i, p in enumerate(rows):
            lines.append(f"  {label if i == 0 else '':8} {_pull_line(p)}")
            if "progress" in p:
                lines.append(f"  {'':8}   {progress_line(p['progress'])}")
    tracing = doc.get("tracing", {})
    if tracing:
        lines.append("tracing    " + "  ".join(f"{k}={v}" for k, v in tracing.items()))
    known = {"version", "pid", "uptime_seconds", "upstream", "pulls", "tracing"}
    for name, value in doc.items():
        if name in known:
            continue
        lines.append(f"{name}:")
        lines += _generic(value, 1) or ["  -"]
    return "\n".join(lines) + "\n"
