"""What the manager's loop (manager.py) asks of a reconciler, as controller-runtime's
``reconcile.Reconciler``: ``reconcile(name)`` brings one object's written state to what the
caches say now, and returns a ``Result`` (``requeue_after``: look again after that many seconds
even if nothing changes; None: only on a change) or raises (the loop retries with the item's
backoff). A reconciler never sets a timer or retries on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol


@dataclass(frozen=True)
class Result:
    requeue_after: float | None = None


class Reconciler(Protocol):
    kind: str  # what it reconciles, for the log ("ImageSet", "PinnedImageSet", ...)

    async def reconcile(self, name: str) -> Result: ...

    def lost_lead(self) -> None:
        """Leadership ended: forget what this process wrote (another leader may write next)."""


class Store(Protocol):
    """An informer's cache (shim/cluster/informer.py), or a dict-backed one in tests."""

    @property
    def items(self) -> Mapping[str, dict[str, Any]]: ...
