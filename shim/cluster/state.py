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
import os
import tempfile
from pathlib import Path
from typing import Any

VERSION = 1


def save(path: str, labels: dict[str, str], own: list[dict[str, Any]], pinned: list[dict[str, Any]]) -> None:
    doc = {"version": VERSION, "labels": labels, "imageSets": own, "pinnedImageSets": pinned}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def probe(path: str) -> None:
    """Raises OSError when a file cannot be created beside ``path`` (what ``save`` needs)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    os.close(fd)
    os.unlink(tmp)


def load(path: str) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(labels, ImageSet objects, PinnedImageSet objects), or None when there is no file.

    Raises ValueError when the file is unreadable or not ours."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"{path}: not a cri-shim cluster state file (version {VERSION})")
    return dict(doc.get("labels") or {}), list(doc.get("imageSets") or []), list(doc.get("pinnedImageSets") or [])
