"""The admin socket (``server.admin_socket``): the server, on the shim's loop, and its client.

The server speaks just enough HTTP/1.1 on a unix socket (mode 0600: root only, like the CRI
socket's data it reveals): ``GET /status`` returns the status document (process/status_document.py) as
JSON, then the connection closes. A request head is read for at most ``_READ_TIMEOUT``
seconds and ``_MAX_REQUEST_HEAD`` bytes. The client (``fetch_status``) is what `cri-shim
status` uses; its errors say what an operator should check.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import socket
from typing import Any, Callable

from ..observability import logs
from .unixsock import StartupError, claim

_log = logs.get("status")

_MAX_REQUEST_HEAD = 8192
_READ_TIMEOUT = 5.0


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
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=_MAX_REQUEST_HEAD)
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
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
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
        doc = json.loads(body)
    except ValueError:
        raise StatusError(f"{admin_socket} answered something that is not JSON") from None
    if not isinstance(doc, dict):
        raise StatusError(f"{admin_socket} answered JSON that is not an object")
    return doc


