"""How the controller writes: server-side apply (field manager ``cri-shim-controller``, forced: the
fields are ours), to an ImageSet's status subresource or a whole PinnedImageSetReport. A failed
write marks its set again after a backoff (1 s doubling to 30 s over the controller's failures),
and says so once per failure in the log."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from kubernetes_asyncio.client import CustomObjectsApi

from ..cluster.informer import describe
from ..cluster.objects import Kind
from ..observability import logs
from .report import FIELD_MANAGER

_log = logs.get("controller")


class Applier:
    def __init__(self, custom: CustomObjectsApi, request_timeout: float) -> None:
        self.custom = custom
        self.request_timeout = request_timeout
        self.writes = 0
        self.errors = 0

    async def apply(self, kind: Kind, name: str, body: dict[str, Any], *, status: bool, what: str,
                    retry: Callable[[str], None]) -> bool:
        """True when written; else ``retry(name)`` is called later. ``status``: to the status subresource."""
        fn = self.custom.patch_cluster_custom_object_status if status else self.custom.patch_cluster_custom_object
        try:
            await fn(kind.group, kind.version, kind.plural, name, body,  # type: ignore[call-arg]  # .pyi lacks _content_type
                     field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
                     _request_timeout=self.request_timeout)
        except Exception as e:
            self.errors += 1
            logs.log(_log, logging.WARNING, f"cannot write {what}; will retry", set=name, error=describe(e))
            asyncio.get_running_loop().call_later(min(30.0, 1.0 * 2 ** min(self.errors, 5)), retry, name)
            return False
        self.writes += 1
        return True
