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

import json
from typing import Any, Iterator

from .. import statefile
from ..statefile import probe

__all__ = ["VERSION", "load", "probe", "save"]

VERSION = 1


def _chunks(labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]]) -> Iterator[str]:
    """The document encoded one object at a time: the thread that saves 25 objects of 4,000 images
    holds the GIL for one object's encoding (about 2 ms), never the whole file's (relayed calls wait on it)."""
    yield f'{{"version":{VERSION},"labels":{json.dumps(labels, separators=(",", ":"))}'
    for key, objs in (("imageSets", own), ("pinnedImageSets", pinned)):
        yield f',"{key}":['
        for i, o in enumerate(objs):
            yield ("," if i else "") + json.dumps(o, separators=(",", ":"))
        yield "]"
    yield "}"


def save(path: str, labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]]) -> None:
    statefile.save_text(path, _chunks(labels, own, pinned))


def load(path: str) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(labels, ImageSet objects, PinnedImageSet objects), or None when there is no file.

    Raises ValueError when the file is unreadable or not ours."""
    doc = statefile.load(path, "cri-shim cluster state file", VERSION)
    if doc is None:
        return None
    return dict(doc.get("labels") or {}), list(doc.get("imageSets") or []), list(doc.get("pinnedImageSets") or [])
