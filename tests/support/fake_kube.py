"""An in-process HTTP server speaking just enough of the Kubernetes API for the cluster
source's readers: list and watch of collections (JSON, chunked watch events), discovery
documents, ``/readyz``; scripted answers (``fail``) and an outage (``down`` / ``up``) on the
same port. Every request is recorded (``requests``), so tests count what a reader asked.
Writers too, as the API server answers them: a server-side apply (PATCH) creates the object
(201, with a uid) or replaces the fields it sends (200); a POST creates (201, ``generateName``
honoured); a DELETE removes (200). ``remove`` deletes as an operator would.

    api = await FakeKube().start()
    client = api.client()                 # a kubernetes_asyncio ApiClient pointed at it
    api.put("/api/v1/nodes", {"metadata": {"name": "n1"}})
    api.fail("/api/v1/nodes", 429, headers={"Retry-After": "1"})   # the next request answers 429
    await api.down(); await api.up()
    await api.stop()
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import defaultdict
from typing import Any

from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.support.registry import free_port


CHANGES = ("ADDED", "MODIFIED", "DELETED")


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def matches(obj: dict[str, Any] | None, selector: str) -> bool:
    """Whether ``obj`` matches a field selector (``a.b=v``, ``a.b!=v``, comma-separated), as the API server
    evaluates it (a field that is not set is the empty string)."""
    if obj is None:
        return False
    for req in filter(None, selector.split(",")):
        if "!=" in req:
            f, v = req.split("!=", 1)
            if _field(obj, f) == v:
                return False
        else:
            f, v = req.split("=", 1)
            if _field(obj, f.rstrip("=")) != v:
                return False
    return True


def _seen_as(ev: dict[str, Any], old: dict[str, Any] | None, selector: str) -> dict[str, Any] | None:
    """The event a watch with ``selector`` gets: an object that stops matching is DELETED for it,
    one that starts matching ADDED; one that never matched, nothing."""
    if not selector:
        return ev
    now = ev["type"] != "DELETED" and matches(ev["object"], selector)
    before = ev["type"] != "ADDED" and matches(old, selector)
    if now and before:
        return ev
    if now:
        return {"type": "ADDED", "object": ev["object"]}
    if before:
        return {"type": "DELETED", "object": ev["object"]}
    return None


class FakeKube:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rv = 1
        self.collections: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.discovery: dict[str, dict[str, Any]] = {}  # path -> document; any other /apis/... path: 404
        self.requests: list[tuple[str, bool]] = []  # (path, watch)
        self.queries: list[dict[str, str]] = []  # each GET's path and query parameters
        self.ready = True
        self._failures: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
        # each open watch: its field selector and its queue of (event, the object before it)
        self._watchers: dict[str, list[tuple[str, asyncio.Queue[Any]]]] = defaultdict(list)
        # (rv, event, the object before it), replayed
        self._log: dict[str, list[tuple[int, dict[str, Any], dict[str, Any] | None]]] = defaultdict(list)
        self._runner: web.AppRunner | None = None
        self._clients: list[ApiClient] = []
        self._uids = itertools.count(1)
        self.writes: list[tuple[str, str, int]] = []  # (method, path, status answered)

    # ------------------------------------------------------------------ scripting

    def put(self, path: str, obj: dict[str, Any]) -> None:
        """Create or replace an object of the collection at ``path``; watchers see it."""
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        old = self.collections[path].get(name)
        kind = "MODIFIED" if old is not None else "ADDED"
        self.collections[path][name] = obj
        self._log[path].append((self.rv, {"type": kind, "object": obj}, old))
        for _, q in self._watchers[path]:
            q.put_nowait(({"type": kind, "object": obj}, old))

    def remove(self, path: str, name: str) -> None:
        """Delete an object of the collection at ``path``; watchers see it."""
        obj = self.collections[path].pop(name)
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self._log[path].append((self.rv, {"type": "DELETED", "object": obj}, obj))
        for _, q in self._watchers[path]:
            q.put_nowait(({"type": "DELETED", "object": obj}, obj))

    def _stored(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """``put`` with what the API server adds to a new object (uid, creationTimestamp)."""
        meta = obj.setdefault("metadata", {})
        old = self.collections[path].get(meta["name"])
        if old is None:
            meta.setdefault("uid", f"uid-{next(self._uids)}")
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        else:
            meta.update({k: old["metadata"][k] for k in ("uid", "creationTimestamp") if k in old["metadata"]})
        self.put(path, obj)
        return self.collections[path][meta["name"]]

    async def _write(self, request: web.Request) -> web.Response:
        path = request.path
        self.requests.append((path, False))
        if self._failures[path]:
            status, headers = self._failures[path].pop(0)
            self.writes.append((request.method, path, status))
            return web.json_response({"kind": "Status", "code": status, "message": f"scripted {status}"},
                                     status=status, headers=headers)
        if request.method == "POST":
            obj = json.loads(await request.read())
            meta = obj.setdefault("metadata", {})
            meta.setdefault("name", f"{meta.get('generateName', '')}{next(self._uids):05}")
            self.writes.append(("POST", path, 201))
            return web.json_response(self._stored(path, obj), status=201)
        parent, _, name = path.rpartition("/")
        if request.method == "DELETE":
            if name not in self.collections[parent]:
                return web.json_response({"kind": "Status", "code": 404}, status=404)
            self.remove(parent, name)
            self.writes.append(("DELETE", path, 200))
            return web.json_response({"kind": "Status", "status": "Success"})
        body = json.loads(await request.read())  # PATCH: apply (the fields sent replace the stored ones)
        old = self.collections[parent].get(name)
        status = 200 if old is not None else 201
        obj = {**(old or {}), **body, "metadata": {**((old or {}).get("metadata") or {}), **body.get("metadata", {}),
                                                   "name": name}}
        self.writes.append(("PATCH", path, status))
        return web.json_response(self._stored(parent, obj), status=status)

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
        self.queries.append({"path": path, **request.query})
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
        items = [o for o in items if matches(o, field)]
        if not watch:
            return web.json_response({"metadata": {"resourceVersion": str(self.rv)}, "items": items})
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        q: asyncio.Queue[Any] = asyncio.Queue()
        since = int(request.query.get("resourceVersion") or 0)
        for rv, ev, old in self._log[path]:  # what happened since the watch's resourceVersion, as etcd replays it
            if rv > since:
                q.put_nowait((ev, old))
        watcher = (field, q)
        self._watchers[path].append(watcher)
        try:
            while (item := await q.get()) is not None:
                seen = _seen_as(*item, field) if item[0].get("type") in CHANGES else item[0]
                if seen is not None:
                    await resp.write(json.dumps(seen).encode() + b"\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away, or down() closes the connection
            pass
        finally:
            self._watchers[path].remove(watcher)
        return resp

    async def start(self) -> "FakeKube":
        await self.up()
        return self

    async def up(self) -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        for method in ("PATCH", "POST", "DELETE"):
            app.router.add_route(method, "/{tail:.*}", self._write)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    def end_watches(self, path: str | None = None) -> None:
        """End the open watches (of ``path``, else all), as a server does at their timeout."""
        for p, qs in self._watchers.items():
            if path is None or p == path:
                for _, q in qs:
                    q.put_nowait(None)

    def watch_event(self, path: str, event: dict[str, Any]) -> None:
        """Send ``event`` as it is to the open watches of ``path`` (e.g. an ERROR the server sends)."""
        for _, q in self._watchers[path]:
            q.put_nowait((event, None))

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
