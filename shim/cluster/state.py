"""The last applied cluster sets, on the node's disk (``cluster.state_file``).

Written (atomically: temp file + rename) after every change that was applied; read once at
start, before the shim serves, so the same pins hold from the first CRI call even when the API
server cannot be reached. It holds the node's labels and the set objects that applied, never a
Secret's content.

Its directory must be writable by the shim: the shipped unit makes it so with
``StateDirectory=cri-shim`` (``/var/lib/cri-shim``, the default's directory) under
``ProtectSystem=strict``. ``probe`` checks that at start, before anything needs saving.
"""

from __future__ import annotations

from typing import Any

from .. import statefile
from ..statefile import probe

__all__ = ["VERSION", "load", "probe", "save"]

VERSION = 1


def save(path: str, labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]]) -> None:
    statefile.save(path, {"version": VERSION, "labels": labels, "imageSets": own, "pinnedImageSets": pinned})


def load(path: str) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(labels, ImageSet objects, PinnedImageSet objects), or None when there is no file.

    Raises ValueError when the file is unreadable or not ours."""
    doc = statefile.load(path, "cri-shim cluster state file", VERSION)
    if doc is None:
        return None
    return dict(doc.get("labels") or {}), list(doc.get("imageSets") or []), list(doc.get("pinnedImageSets") or [])
