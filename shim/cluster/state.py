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

__all__ = ["VERSION", "Encoded", "load", "probe", "save"]

VERSION = 1


Encoded = dict[tuple[str, str, str], str]  # (kind, uid, resourceVersion) -> the object's JSON


def _key(o: dict[str, Any]) -> tuple[str, str, str] | None:
    meta = o.get("metadata") or {}
    rv = meta.get("resourceVersion")
    return (str(o.get("kind")), str(meta.get("uid", "")), str(rv)) if rv else None


def _chunks(labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]],
            encoded: Encoded | None) -> Iterator[str]:
    """The document encoded one object at a time: the thread that saves 25 objects of 4,000 images
    holds the GIL for one object's encoding (about 2 ms), never the whole file's (relayed calls wait
    on it). ``encoded``: the objects encoded by the last save, by version (reused, then replaced by
    this save's: an edit of one set encodes that set alone)."""
    last = dict(encoded or {})
    if encoded is not None:
        encoded.clear()
    yield f'{{"version":{VERSION},"labels":{json.dumps(labels, separators=(",", ":"))}'
    for name, objs in (("imageSets", own), ("pinnedImageSets", pinned)):
        yield f',"{name}":['
        for i, o in enumerate(objs):
            key = _key(o)
            text = last.get(key) if key is not None else None
            if text is None:
                text = json.dumps(o, separators=(",", ":"))
            if key is not None and encoded is not None:
                encoded[key] = text
            yield ("," if i else "") + text
        yield "]"
    yield "}"


def save(path: str, labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]],
         encoded: Encoded | None = None) -> None:
    """Raises OSError. ``encoded``: kept by the caller between saves (see ``_chunks``)."""
    statefile.save_text(path, _chunks(labels, own, pinned, encoded))


def load(path: str) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(labels, ImageSet objects, PinnedImageSet objects), or None when there is no file.

    Raises ValueError when the file is unreadable or not ours."""
    doc = statefile.load(path, "cri-shim cluster state file", VERSION)
    if doc is None:
        return None
    return dict(doc.get("labels") or {}), list(doc.get("imageSets") or []), list(doc.get("pinnedImageSets") or [])
