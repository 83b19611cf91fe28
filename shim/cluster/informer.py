"""List + watch of one resource, kept as a dict of objects by name.

* One list, then watches from its resourceVersion with bookmarks on (``allowWatchBookmarks``),
  so a quiet resource keeps a fresh resourceVersion and a resumed watch does not hit 410.
* A watch that ends (server timeout, connection closed) resumes from the last resourceVersion
  seen (an event's or a bookmark's): no re-list. Each watch request asks the server to end it
  after ``cluster.watch_timeout_seconds`` x (1 + a random fraction), so renewals spread out.
* 410 Gone (that resourceVersion is compacted away): one re-list, then watching again.
* 429 with ``Retry-After``: waited out (at most ``backoff_max_seconds``), not a failure.
* Any other error (API server down, 5xx, 403): wait with exponential backoff and full jitter
  (``cluster.backoff_initial_seconds`` .. ``backoff_max_seconds``), then resume the watch; a
  re-list happens only when none has succeeded yet. The wait ends early when the API server is
  seen answering again (reachability.py: another reader's success, or the /readyz probe), so
  every watch resumes within about ``cluster.probe_interval_seconds`` of the API server's return.
* ``give_up_on``: HTTP statuses that end ``run()`` instead of retrying (a Secret whose watch
  RBAC does not allow falls back to reading it by name).
* ``key`` names an object in ``items`` (default its ``metadata.name``; pods of many namespaces:
  their uid); ``shrink`` (optional) replaces each object by what the caller keeps of it before
  it is stored or handed to ``on_event`` (the rest of the decoded JSON is garbage at once);
  ``max_items`` (optional) bounds ``items``: an object beyond it is not kept (``not_kept``
  counts each time one was not) until one is deleted and it changes again.
* ``on_change`` is called after every change (synchronously, in the loop; coalescing is the
  caller's business). ``on_event`` (optional) also gets what changed: ``(type, old, new)`` per
  watch event (``ADDED``/``MODIFIED``/``DELETED``; old or new None where there is none), and
  ``("LIST", None, None)`` after a (re-)list, when anything may have changed.

Lists and watch events are read as JSON (``_preload_content=False``), not as client models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any, Callable

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from ..observability import logs
from .reachability import Reachability, retry_after
from .reachability import backoff as backoff  # re-exported: tests, node_report.py
from .reachability import describe as describe

_log = logs.get("cluster")

ListFn = Callable[..., Any]
Obj = dict[str, Any] | None
EventFn = Callable[[str, Obj, Obj], None]


async def open_response(resp: Any) -> Any:
    """The aiohttp response of a ``_preload_content=False`` call; ApiException unless 2xx."""
    if not 200 <= resp.status <= 299:
        try:
            body = await resp.read()
        finally:
            resp.release()
        e = ApiException(status=resp.status, reason=resp.reason)
        e.body, e.headers = body, resp.headers  # Retry-After is read from here
        raise e
    return resp


def _by_name(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["name"])


class Informer:
    def __init__(self, api: ApiClient, name: str, list_fn: ListFn, *, on_change: Callable[[], None],
                 reach: Reachability, kind: tuple[str, str] | None = None, on_event: EventFn | None = None,
                 watch_timeout: float = 300.0,
                 request_timeout: float = 30.0, backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 give_up_on: frozenset[int] = frozenset(), key: Callable[[dict[str, Any]], str] | None = None,
                 shrink: Callable[[dict[str, Any]], dict[str, Any]] | None = None, max_items: int | None = None,
                 **list_kwargs: Any) -> None:
        self.api = api
        self.name = name
        self._list_fn = list_fn
        self._kwargs = list_kwargs
        self._on_change = on_change
        self._on_event = on_event
        self._reach = reach
        self._kind = kind  # (apiVersion, kind) filled in where the API omits them
        self._give_up_on = give_up_on
        self._key = key or _by_name
        self._shrink = shrink
        self.max_items = max_items
        self.not_kept = 0  # objects not stored because ``items`` held ``max_items``
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.items: dict[str, dict[str, Any]] = {}
        self.synced = False
        self.resource_version: str | None = None
        self.error = ""
        self.lists = 0
        self.watches = 0
        self.failures = 0
        self.throttled = 0  # 429s waited out

    def _obj(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self._shrink is not None:
            return self._shrink(obj)
        if self._kind is not None:
            obj.setdefault("apiVersion", self._kind[0])
            obj.setdefault("kind", self._kind[1])
        return obj

    async def _list(self) -> None:
        resp = await open_response(await self._list_fn(**self._kwargs, _preload_content=False,
                                               _request_timeout=self.request_timeout))
        self.lists += 1  # answered
        try:
            body = json.loads(await resp.read())
        finally:
            resp.release()
        self._answered()
        items: dict[str, dict[str, Any]] = {}
        for o in body.get("items") or []:
            if self.max_items is not None and len(items) >= self.max_items:
                self.not_kept += 1
                continue
            items[self._key(o)] = self._obj(o)
        self.items = items
        self.resource_version = body["metadata"]["resourceVersion"]
        self.synced = True
        if self._on_event is not None:
            self._on_event("LIST", None, None)
        self._on_change()

    async def _watch(self) -> None:
        assert self.resource_version is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout,
                                        sock_read=2 * self.watch_timeout + self.request_timeout)
        # jittered like client-go's (timeout .. 2 x timeout): a fleet started together does not
        # renew its watches together
        seconds = max(1, int(self.watch_timeout * (1 + random.random())))
        resp = await open_response(await self._list_fn(
            **self._kwargs, watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
            timeout_seconds=seconds, _preload_content=False, _request_timeout=timeout))
        self.watches += 1  # open
        try:
            self._answered()  # the watch is open: the API server answers
            while line := await resp.content.readline():
                if line.strip():
                    self._event(json.loads(line))
        finally:
            if resp.content.at_eof():
                resp.release()  # ended by the server: the connection can serve the next request
            else:
                resp.close()  # cancelled or broken mid-stream: the server sees the watch end

    def _event(self, ev: dict[str, Any]) -> None:
        kind, obj = ev.get("type"), ev.get("object") or {}
        if kind == "ERROR":  # a Status: 410 Gone when the resourceVersion is compacted away
            raise ApiException(status=obj.get("code") or 500, reason=f"{obj.get('reason')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            name = self._key(obj)
            obj = self._obj(obj)
            if kind == "DELETED":
                old = self.items.pop(name, None)
            else:
                old = self.items.get(name)
                if old is None and self.max_items is not None and len(self.items) >= self.max_items:
                    self.not_kept += 1
                    if rv:
                        self.resource_version = rv
                    return
                self.items[name] = obj
            if self._on_event is not None:
                self._on_event(kind, old, None if kind == "DELETED" else obj)
            self._on_change()
        if rv:  # an event's or a BOOKMARK's
            self.resource_version = rv

    def _answered(self) -> None:
        self._reach.succeeded(self.name)
        if self.error or self.failures:
            logs.log(_log, logging.INFO, "watching again", resource=self.name)
            self.failures, self.error = 0, ""

    async def run(self) -> None:
        try:
            while True:
                try:
                    if self.resource_version is None:
                        await self._list()
                    await self._watch()
                except asyncio.CancelledError:
                    raise
                except ApiException as e:
                    if e.status == 410:
                        logs.log(_log, logging.INFO, "resourceVersion expired; listing again", resource=self.name)
                        self.resource_version = None
                        continue
                    if e.status in self._give_up_on:
                        self._note(e)
                        return
                    await self._failed(e)
                except Exception as e:  # connection refused, TLS, timeouts, bad JSON: all retried
                    await self._failed(e)
        finally:
            self._reach.forget(self.name)

    def _note(self, e: BaseException) -> None:
        err = describe(e)
        if err != self.error:
            logs.log(_log, logging.WARNING, "cannot read from the API server", resource=self.name, error=err)
        self.error = err

    async def _failed(self, e: BaseException) -> None:
        wait = retry_after(e, self.backoff_max)
        if wait is not None:  # asked to come back later: not a failure, no backoff
            self.throttled += 1
            await asyncio.sleep(wait * (1 + 0.2 * random.random()))  # spread a fleet's retries
            return
        self.failures += 1
        self._reach.failed(self.name, e)
        delay = backoff(self.failures, self.backoff_initial, self.backoff_max)
        err = describe(e)
        if err != self.error:
            logs.log(_log, logging.WARNING, "cannot read from the API server; retrying", resource=self.name,
                     error=err, retry_in=round(delay, 3))
        self.error = err
        if await self._reach.wait(delay):
            self.failures = 0  # the API server answers again: the next error starts from the initial delay
