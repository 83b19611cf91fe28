"""Pull secrets named by cluster sets (``kubernetes.io/dockerconfigjson``), read by name only.

Each Secret a set names is watched by name (a list + watch with ``fieldSelector
metadata.name=<name>`` in its namespace, as kubelet watches the Secrets its pods use): RBAC
names exactly the Secrets the shim may read (``resourceNames`` with ``get, list, watch``), a
rotated Secret is used as soon as it changes, and at rest a Secret costs one watch renewal per
``cluster.watch_timeout_seconds`` (x 1..2) instead of a read by every node every few minutes.
The watch ends when no set names the Secret any more.

Where RBAC allows only ``get`` (the list answers 403), the Secret is read with a GET when a set
first names it and again every ``cluster.secret_refresh_seconds`` (``due`` / ``refresh``).

Its entries are parsed with the node's config.json parser and offered for the images of the sets
that name it, before the node's own credentials. A Secret that cannot be read, is deleted or
unusable keeps its last good entries (``errors`` says why). Never logged, never written to the
state file.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from functools import partial
from typing import Any, Callable

from kubernetes_asyncio.client import CoreV1Api

from ..credentials import Credential
from ..credentials.dockerconfig import ConfigFileError, parse
from ..observability import logs
from .informer import Informer
from .objects import DOCKER_CONFIG_JSON, SecretRef
from .reachability import describe

_log = logs.get("cluster")

# A watch of one Secret by name, calling back on every change (source.py builds it).
Watcher = Callable[[SecretRef, Callable[[], None]], Informer]


class PullSecrets:
    def __init__(self, core: CoreV1Api, *, refresh_seconds: float, request_timeout: float,
                 clock: Callable[[], float] = time.monotonic, watcher: Watcher | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.core = core
        self.refresh_seconds = refresh_seconds
        self.request_timeout = request_timeout
        self._clock = clock
        self._watcher = watcher  # None: every Secret read with GET (no watch)
        self._on_change = on_change  # entries changed through a watch
        self.entries: dict[SecretRef, list[tuple[str, Credential]]] = {}
        self.errors: dict[SecretRef, str] = {}
        self._fetched: dict[SecretRef, float] = {}
        self._watches: dict[SecretRef, tuple[Informer, asyncio.Task[None]]] = {}
        self._get_only: set[SecretRef] = set()  # its watch was refused (RBAC allows get only)
        self._first_gets: set[asyncio.Task[None]] = set()  # the GET right after a watch was refused
        self.by_set: dict[str, tuple[SecretRef, ...]] = {}

    def name_sets(self, by_set: dict[str, tuple[SecretRef, ...]]) -> None:
        """The pull secrets each applied set names now (``sync`` watches them)."""
        self.by_set = by_set

    def watches(self) -> dict[SecretRef, asyncio.Task[None]]:
        """The Secrets watched now, and the task of each watch."""
        return {ref: task for ref, (_, task) in self._watches.items()}

    def _secrets_named(self) -> set[SecretRef]:
        return {r for refs in self.by_set.values() for r in refs}

    def for_sets(self, names: frozenset[str]) -> list[tuple[str, Credential]]:
        out: list[tuple[str, Credential]] = []
        seen: set[SecretRef] = set()
        for name in sorted(names):
            for ref in self.by_set.get(name, ()):
                if ref not in seen:
                    seen.add(ref)
                    out += self.entries.get(ref, [])
        return out

    # ------------------------------------------------------------------ watched

    def sync(self) -> None:
        """Watch every Secret the sets name now (``by_set``), and only those."""
        if self._watcher is None:
            return
        named = self._secrets_named()
        for ref in list(self._watches):
            if ref not in named:
                inf, task = self._watches.pop(ref)
                task.cancel()
        for ref in set(self.entries) | set(self.errors) | self._get_only:
            if ref not in named:
                self.entries.pop(ref, None)
                self.errors.pop(ref, None)
                self._fetched.pop(ref, None)
                self._get_only.discard(ref)
        loop = asyncio.get_running_loop()
        for ref in sorted(named - set(self._watches) - self._get_only, key=lambda r: (r.namespace, r.name)):
            inf = self._watcher(ref, partial(self._watched, ref))
            task = loop.create_task(inf.run(), name=f"cluster-secret-{ref.namespace}-{ref.name}")
            task.add_done_callback(partial(self._watch_ended, ref))
            self._watches[ref] = (inf, task)

    def _watched(self, ref: SecretRef) -> None:
        inf, _ = self._watches[ref]
        where = f"Secret {ref.namespace}/{ref.name}"
        obj = inf.items.get(ref.name)
        if obj is None:
            self._error(ref, f"{where}: HTTP 404: Not Found")
            return
        if self._store(ref, obj, where):
            self._on_change()

    def _watch_ended(self, ref: SecretRef, task: asyncio.Task[None]) -> None:
        """The watch gave up (its list answered 403): read this Secret by name instead."""
        entry = self._watches.get(ref)
        if task.cancelled() or entry is None or entry[1] is not task:
            return
        del self._watches[ref]
        self._get_only.add(ref)
        logs.log(_log, logging.WARNING, "cannot watch a pull secret (RBAC allows get only: add list, watch to its "
                 "Role, see deploy/cluster/rbac.yaml); reading it every cluster.secret_refresh_seconds instead",
                 secret=f"{ref.namespace}/{ref.name}", error=entry[0].error)
        first = asyncio.get_running_loop().create_task(self._first_get(ref), name="cluster-secret-first-get")
        self._first_gets.add(first)
        first.add_done_callback(self._first_gets.discard)

    async def _first_get(self, ref: SecretRef) -> None:
        """Read it now, not at the next refresh tick: its entries, or why it cannot be read, are known at once."""
        if ref in self._get_only and await self.refresh([ref]):
            self._on_change()

    async def stop(self) -> None:
        tasks = [t for _, t in self._watches.values()] + list(self._first_gets)
        self._watches.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ read by name

    def due(self) -> list[SecretRef]:
        """The Secrets to GET now: not watched, and not read for ``refresh_seconds``."""
        now = self._clock()
        return sorted((r for r in self._secrets_named() if r not in self._watches
                       and now - self._fetched.get(r, -1e18) >= self.refresh_seconds),
                      key=lambda r: (r.namespace, r.name))

    async def refresh(self, refs: list[SecretRef]) -> bool:
        """Read these Secrets; True when some entries changed."""
        changed = False
        for ref in refs:
            self._fetched[ref] = self._clock()
            where = f"Secret {ref.namespace}/{ref.name}"
            try:
                secret: Any = await self.core.read_namespaced_secret(ref.name, ref.namespace,
                                                                     _request_timeout=self.request_timeout)
            except Exception as e:  # not found, forbidden, API down: keep the last good entries
                self._error(ref, f"{where}: {describe(e)}")
                continue
            changed |= self._store(ref, {"type": secret.type, "data": secret.data}, where)
        return changed

    # ------------------------------------------------------------------ both

    def _store(self, ref: SecretRef, obj: dict[str, Any], where: str) -> bool:
        """Parse a Secret read or watched; True when its entries changed."""
        try:
            if obj.get("type") != DOCKER_CONFIG_JSON:
                raise ConfigFileError(f"{where}: type is {obj.get('type')!r}, expected {DOCKER_CONFIG_JSON}")
            raw = (obj.get("data") or {}).get(".dockerconfigjson", "")
            entries = parse(base64.b64decode(raw).decode(), where)
        except ConfigFileError as e:
            self._error(ref, str(e))
            return False
        except ValueError as e:  # bad base64 or UTF-8: the message names no content
            self._error(ref, f"{where}: .dockerconfigjson is not base64 of UTF-8 text ({type(e).__name__})")
            return False
        if self.errors.pop(ref, None):
            logs.log(_log, logging.INFO, "pull secret readable again", secret=f"{ref.namespace}/{ref.name}")
        changed = self.entries.get(ref) != entries
        self.entries[ref] = entries
        return changed

    def _error(self, ref: SecretRef, err: str) -> None:
        if self.errors.get(ref) != err:
            logs.log(_log, logging.WARNING, "pull secret unusable; its last good entries stay", error=err)
        self.errors[ref] = err

    def status(self) -> dict[str, Any]:
        return {f"{r.namespace}/{r.name}": self.errors.get(r, "ok") for r in
                sorted(self._secrets_named(), key=lambda r: (r.namespace, r.name))}
