"""Pull secrets named by cluster sets (``kubernetes.io/dockerconfigjson``), read by name only.

Each Secret is read with a GET (RBAC can then name exactly the Secrets the shim may read) when a
set first names it and again every ``cluster.secret_refresh_seconds``. Its entries are parsed with
the node's config.json parser and offered for the images of the sets that name it, before the
node's own credentials. A Secret that cannot be read keeps its last good entries. Never logged,
never written to the state file.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any, Callable

from kubernetes_asyncio.client import CoreV1Api

from ..credentials import Credential
from ..credentials.dockerconfig import ConfigFileError, parse
from ..observability import logs
from .informer import describe
from .objects import DOCKER_CONFIG_JSON, SecretRef

_log = logs.get("cluster")


class PullSecrets:
    def __init__(self, core: CoreV1Api, *, refresh_seconds: float, request_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.refresh_seconds = refresh_seconds
        self.request_timeout = request_timeout
        self._clock = clock
        self.entries: dict[SecretRef, list[tuple[str, Credential]]] = {}
        self.errors: dict[SecretRef, str] = {}
        self._fetched: dict[SecretRef, float] = {}
        self.by_set: dict[str, tuple[SecretRef, ...]] = {}

    def for_sets(self, names: frozenset[str]) -> list[tuple[str, Credential]]:
        out: list[tuple[str, Credential]] = []
        seen: set[SecretRef] = set()
        for name in sorted(names):
            for ref in self.by_set.get(name, ()):
                if ref not in seen:
                    seen.add(ref)
                    out += self.entries.get(ref, [])
        return out

    def due(self) -> list[SecretRef]:
        now = self._clock()
        refs = {r for refs in self.by_set.values() for r in refs}
        return sorted((r for r in refs if now - self._fetched.get(r, -1e18) >= self.refresh_seconds),
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
                if secret.type != DOCKER_CONFIG_JSON:
                    raise ConfigFileError(f"{where}: type is {secret.type!r}, expected {DOCKER_CONFIG_JSON}")
                raw = (secret.data or {}).get(".dockerconfigjson", "")
                entries = parse(base64.b64decode(raw).decode(), where)
            except ConfigFileError as e:
                self._error(ref, str(e))
                continue
            except Exception as e:  # not found, forbidden, API down: keep the last good entries
                self._error(ref, f"{where}: {describe(e)}")
                continue
            if self.errors.pop(ref, None):
                logs.log(_log, logging.INFO, "pull secret readable again", secret=f"{ref.namespace}/{ref.name}")
            changed |= self.entries.get(ref) != entries
            self.entries[ref] = entries
        return changed

    def _error(self, ref: SecretRef, err: str) -> None:
        if self.errors.get(ref) != err:
            logs.log(_log, logging.WARNING, "pull secret unusable; its last good entries stay", error=err)
        self.errors[ref] = err

    def status(self) -> dict[str, Any]:
        return {f"{r.namespace}/{r.name}": self.errors.get(r, "ok") for r in
                sorted({r for refs in self.by_set.values() for r in refs}, key=lambda r: (r.namespace, r.name))}
