"""An in-process HTTP server speaking just enough of the Kubernetes API for the cluster
source's readers: list and watch of collections (JSON, chunked watch events), discovery
documents, ``/readyz``; scripted answers (``fail``) and an outage (``down`` / ``up``) on the
same port. Every request is recorded (``requests``), so tests count what a reader asked.

    api = await FakeKube().start()
    client = api.client()                 # a kubernetes_asyncio ApiClient pointed at it
    api.put("/api/v1/nodes", {"metadata": {"name": "n1"}})
    api.fail("/api/v1/nodes", 429, headers={"Retry-After": "1"})   # the next request answers 429
    await api.down(); await api.up()
    await api.stop()
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.support.registry import free_port


class FakeKube:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rv = 1
        self.collections: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.discovery: dict[str, dict[str, Any]] = {}  # path -> document; any other /apis/... path: 404
        self.requests: list[tuple[str, bool]] = []  # (path, watch)
        self.ready = True
        self._failures: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
        self._watchers: dict[str, list[asyncio.Queue[dict[str, Any] | None]]] = defaultdict(list)
        self._log: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)  # (rv, event), replayed
        self._runner: web.AppRunner | None = None
        self._clients: list[ApiClient] = []

    # ------------------------------------------------------------------ scripting

    def put(self, path: str, obj: dict[str, Any]) -> None:
        """Create or replace an object of the collection at ``path``; watchers see it."""
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.collections[path] else "ADDED"
        self.collections[path][name] = obj
        self._log[path].append((self.rv, {"type": kind, "object": obj}))
        for q in self._watchers[path]:
            q.put_nowait({"type": kind, "object": obj})

    def fail(self, path: str, status: int, *, times: int = 1, headers: dict[str, str] | None = None) -> None:
        """The next ``times`` requests to ``path`` (list or watch) answer ``status``."""
        self._failures[path] += [(status, headers or {})] * times

    def count(self, path: str, *, watch: bool | None = None) -> int:
        return sum(1 for p, w in self.requests if p == path and (watch is None or w == watch))

    # ------------------------------------------------------------------ serving

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        watch = request.query.get("watch") in ("true", "True", "1")
        self.requests.append((path, watch))
        if path == "/readyz":
            return web.Response(status=200 if self.ready else 500, text="ok" if self.ready else "not ready")
        if self._failures[path]:
            status, headers = self._failures[path].pop(0)
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                    "message": f"scripted {status}"}
            return web.json_response(body, status=status, headers=headers)
        if path in self.discovery:
            return web.json_response(self.discovery[path])
        if path.startswith("/apis/") and path.count("/") <= 3:  # a discovery document not scripted
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        parent, _, name = path.rpartition("/")
        if path not in self.collections and not watch and name in self.collections.get(parent, {}):
            return web.json_response(self.collections[parent][name])  # a GET by name
        if path not in self.collections:
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        items = list(self.collections[path].values())
        field = request.query.get("fieldSelector", "")
        if field.startswith("metadata.name="):
            items = [o for o in items if o["metadata"]["name"] == field.split("=", 1)[1]]
        if not watch:
            return web.json_response({"metadata": {"resourceVersion": str(self.rv)}, "items": items})
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion") or 0)
        for rv, ev in self._log[path]:  # what happened since the watch's resourceVersion, as etcd replays it
            if rv > since:
                q.put_nowait(ev)
        self._watchers[path].append(q)
        try:
            while (ev := await q.get()) is not None:
                await resp.write(json.dumps(ev).encode() + b"\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away, or down() closes the connection
            pass
        finally:
            self._watchers[path].remove(q)
        return resp

    async def start(self) -> "FakeKube":
        await self.up()
        return self

    async def up(self) -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    def end_watches(self, path: str | None = None) -> None:
        """End the open watches (of ``path``, else all), as a server does at their timeout."""
        for p, qs in self._watchers.items():
            if path is None or p == path:
                for q in qs:
                    q.put_nowait(None)

    def watch_event(self, path: str, event: dict[str, Any]) -> None:
        """Send ``event`` as it is to the open watches of ``path`` (e.g. an ERROR the server sends)."""
        for q in self._watchers[path]:
            q.put_nowait(event)

    async def down(self) -> None:
        """An outage: open watches end, then nothing listens on the port."""
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def client(self) -> ApiClient:
        cfg = Configuration(host=self.url)
        cfg.api_key = {"BearerToken": "t"}
        cfg.api_key_prefix = {"BearerToken": "Bearer"}
        api = ApiClient(cfg)
        self._clients.append(api)
        return api

    async def stop(self) -> None:
        for api in self._clients:
            await api.close()
        await self.down()
