"""How the controller writes: server-side apply (field manager ``cri-shim-controller``, forced: the
fields are ours), to an ImageSet's status subresource or a whole PinnedImageSetReport. A write
that fails raises ``WriteError``; the applier never retries on its own: the manager's loop
(manager.py) requeues the set with its own backoff and says so in the log."""

from __future__ import annotations

from typing import Any, Protocol

from kubernetes_asyncio.client import CustomObjectsApi

from ..cluster.informer import describe
from ..cluster.objects import Kind
from .report import FIELD_MANAGER


class WriteError(Exception):
    """A write that failed: ``what`` was not written to ``name``; the message says why."""

    def __init__(self, what: str, name: str, cause: BaseException) -> None:
        super().__init__(describe(cause))
        self.what = what
        self.name = name


class Apply(Protocol):
    """What a reconciler writes through (``Applier``, or a fake in unit tests)."""

    async def apply(self, kind: Kind, name: str, body: dict[str, Any], *, status: bool, what: str) -> None: ...


class Applier:
    def __init__(self, custom: CustomObjectsApi, request_timeout: float) -> None:
        self.custom = custom
        self.request_timeout = request_timeout
        self.writes = 0

    async def apply(self, kind: Kind, name: str, body: dict[str, Any], *, status: bool, what: str) -> None:
        """Written, or ``WriteError``. ``status``: to the status subresource."""
        fn = self.custom.patch_cluster_custom_object_status if status else self.custom.patch_cluster_custom_object
        try:
            await fn(kind.group, kind.version, kind.plural, name, body,  # type: ignore[call-arg]  # .pyi lacks _content_type
                     field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
                     _request_timeout=self.request_timeout)
        except Exception as e:
            raise WriteError(what, name, e) from e
        self.writes += 1
