"""A registry that answers every manifest request with one failure, chosen by the repository.

``FaultRegistry().start()`` serves plain HTTP on 127.0.0.1; ``ref(fault, tail)`` is an image
reference whose first path component names the fault, e.g. ``127.0.0.1:PORT/denied403/x401:v1``.
Runtimes pulling it see the registry answers of :data:`FAULTS` exactly as distribution (and
Docker Hub, quay, ghcr) word them, so a test gets each runtime's own error text for each.
``/v2/`` answers 200 (the API version check), except for the token faults, where a manifest
request gets a Bearer challenge and ``/token`` the failure.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    status: int
    code: str = ""  # the distribution error code in the JSON body; "" = a plain-text body
    message: str = ""
    challenge: str = ""  # WWW-Authenticate
    at_token: bool = False  # the failure comes from the token endpoint after a Bearer challenge


def _body(f: Fault) -> tuple[bytes, str]:
    if not f.code:
        return (http.HTTPStatus(f.status).phrase + "\n").encode(), "text/plain; charset=utf-8"
    return (json.dumps({"errors": [{"code": f.code, "message": f.message, "detail": None}]}).encode(),
            "application/json; charset=utf-8")


#: fault name (the repository's first component) -> what its manifest requests get
FAULTS: dict[str, Fault] = {
    "basic401": Fault(401, "UNAUTHORIZED", "authentication required", 'Basic realm="fault-registry"'),
    "token401": Fault(401, "UNAUTHORIZED", "authentication required", at_token=True),
    "token403": Fault(403, "DENIED", "requested access to the resource is denied", at_token=True),
    "denied403": Fault(403, "DENIED", "requested access to the resource is denied"),
    "plain403": Fault(403),
    "manifest404": Fault(404, "MANIFEST_UNKNOWN", "manifest unknown"),
    "name404": Fault(404, "NAME_UNKNOWN", "repository name not known to registry"),
    "plain404": Fault(404),
    "toomany429": Fault(429, "TOOMANYREQUESTS", "You have reached your pull rate limit."),
    "server500": Fault(500),
    "unavailable503": Fault(503, "UNAVAILABLE", "service unavailable"),
}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/v2", "/v2/"):
            self._send(200, b"{}", "application/json")
            return
        if path == "/token":
            scope = self.path.partition("scope=repository%3A")[2] or self.path.partition("scope=repository:")[2]
            fault = FAULTS.get(scope.split("%2F", 1)[0].split("/", 1)[0])
            if fault is None:
                self._send(400, b"no scope\n", "text/plain")
                return
            self._send(fault.status, *_body(fault))
            return
        parts = path.removeprefix("/v2/").split("/")
        fault = FAULTS.get(parts[0]) if len(parts) >= 3 else None
        if fault is None:
            self._send(404, *_body(FAULTS["name404"]))
            return
        if fault.at_token:
            repo = "/".join(parts[:-2])
            challenge = (f'Bearer realm="http://{self.server.host}/token",service="fault-registry",'
                         f'scope="repository:{repo}:pull"')
            self._send(401, *_body(FAULTS["basic401"]), {"WWW-Authenticate": challenge})
            return
        self._send(fault.status, *_body(fault), {"WWW-Authenticate": fault.challenge} if fault.challenge else None)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    host = ""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is no fault of ours
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class FaultRegistry:
    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self.host = self._server.host = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-registry", daemon=True)

    def start(self) -> FaultRegistry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def ref(self, fault: str, tail: str = "app:v1") -> str:
        return f"{self.host}/{fault}/{tail}"
