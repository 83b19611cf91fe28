"""List + watch of one resource, kept as a dict of objects by name.

* One list, then watches from its resourceVersion with bookmarks on (``allowWatchBookmarks``),
  so a quiet resource keeps a fresh resourceVersion and a resumed watch does not hit 410.
* A watch that ends (server timeout, connection closed) resumes from the last resourceVersion
  seen (an event's or a bookmark's): no re-list. Each watch request asks the server to end it
  after ``cluster.watch_timeout_seconds`` x (1 + a random fraction), so renewals spread out.
* 410 Gone (that resourceVersion is compacted away): one re-list, then watching again.
* Any other error (API server down, 5xx, 403, resource not installed): wait with exponential
  backoff and full jitter (``cluster.backoff_initial_seconds`` .. ``backoff_max_seconds``), then
  resume the watch; a re-list happens only when none has succeeded yet. So an API server restart
  seen by a thousand nodes is not a thousand simultaneous re-lists.
* ``on_change`` is called after every change (synchronously, in the loop; coalescing is the
  caller's business). ``on_event`` (optional) also gets what changed: ``(type, old, new)`` per
  watch event (``ADDED``/``MODIFIED``/``DELETED``; old or new None where there is none), and
  ``("LIST", None, None)`` after a (re-)list, when anything may have changed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable, cast

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from ..observability import logs

_log = logs.get("cluster")

ListFn = Callable[..., Any]
Obj = dict[str, Any] | None
EventFn = Callable[[str, Obj, Obj], None]


def backoff(failures: int, initial: float, maximum: float, rng: Callable[[], float] = random.random) -> float:
    """Full jitter: uniform in [0, min(max, initial * 2^(failures-1))], at least initial/10."""
    cap = min(maximum, initial * (2.0 ** max(failures - 1, 0)))
    return max(initial / 10, cap * rng())


def describe(e: BaseException) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status}: {e.reason}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Informer:
    def __init__(self, api: ApiClient, name: str, list_fn: ListFn, *, on_change: Callable[[], None],
                 kind: tuple[str, str] | None = None, on_event: EventFn | None = None,
                 watch_timeout: float = 300.0,
                 request_timeout: float = 30.0, backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 **list_kwargs: Any) -> None:
        self.api = api
        self.name = name
        self._list_fn = list_fn
        self._kwargs = list_kwargs
        self._on_change = on_change
        self._on_event = on_event
        self._kind = kind  # (apiVersion, kind) filled in where the API omits them
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

    def _obj(self, raw: Any) -> dict[str, Any]:
        obj = raw if isinstance(raw, dict) else self.api.sanitize_for_serialization(raw)
        if self._kind is not None:
            obj.setdefault("apiVersion", self._kind[0])
            obj.setdefault("kind", self._kind[1])
        return obj

    async def _list(self) -> None:
        resp = await self._list_fn(**self._kwargs, _request_timeout=self.request_timeout)
        if not isinstance(resp, dict):
            resp = self.api.sanitize_for_serialization(resp)
        self.lists += 1
        self.items = {o["metadata"]["name"]: self._obj(o) for o in resp.get("items") or []}
        self.resource_version = resp["metadata"]["resourceVersion"]
        self.synced = True
        if self._on_event is not None:
            self._on_event("LIST", None, None)
        self._on_change()

    async def _watch(self) -> None:
        assert self.resource_version is not None
        w = Watch()
        self.watches += 1
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout,
                                        sock_read=2 * self.watch_timeout + self.request_timeout)
        try:
            # jittered like client-go's (timeout .. 2 x timeout): a fleet started together does not
            # renew its watches together
            seconds = max(1, int(self.watch_timeout * (1 + random.random())))
            stream = w.stream(self._list_fn, **self._kwargs, resource_version=self.resource_version,
                              allow_watch_bookmarks=True, timeout_seconds=seconds, _request_timeout=timeout)
            async for ev in stream:
                kind = ev["type"]
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    obj = self._obj(ev["raw_object"])
                    name = obj["metadata"]["name"]
                    if kind == "DELETED":
                        old = self.items.pop(name, None)
                    else:
                        old = self.items.get(name)
                        self.items[name] = obj
                    if self._on_event is not None:
                        self._on_event(kind, old, None if kind == "DELETED" else obj)
                    self._on_change()
                rv = cast("str | None", w.resource_version)  # Watch sets it, but its __init__ types it None
                if rv:
                    self.resource_version = rv
                if self.failures:
                    self._recovered()
        finally:
            await w.close()

    def _recovered(self) -> None:
        logs.log(_log, logging.INFO, "watching again", resource=self.name)
        self.failures, self.error = 0, ""

    async def run(self) -> None:
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                    if self.failures:
                        self._recovered()
                await self._watch()
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status == 410:
                    logs.log(_log, logging.INFO, "resourceVersion expired; listing again", resource=self.name)
                    self.resource_version = None
                    continue
                await self._failed(e)
            except Exception as e:  # connection refused, TLS, timeouts, bad JSON: all retried
                await self._failed(e)

    async def _failed(self, e: BaseException) -> None:
        self.failures += 1
        err = describe(e)
        delay = backoff(self.failures, self.backoff_initial, self.backoff_max)
        if err != self.error:
            logs.log(_log, logging.WARNING, "cannot read from the API server; retrying", resource=self.name,
                     error=err, retry_in=round(delay, 3))
        self.error = err
        await asyncio.sleep(delay)
