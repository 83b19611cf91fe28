"""A small JSON document on the node's disk that must survive a restart (a state file).

``save`` is atomic (a temp file beside it, fsync, rename): a crash leaves the old document
or the new one, never half of one. ``probe`` checks at start that ``save`` will be able to
create its temp file. ``load`` reads one back, ``None`` when there is none. The state
files: ``cluster.state_file`` (shim/cluster/state.py) and ``image_sets.state_file``
(shim/imagesets/state.py); under systemd the unit's ``StateDirectory=cri-shim`` makes their
default directory, ``/var/lib/cri-shim``, writable.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable


def save(path: str, doc: dict[str, Any]) -> None:
    """Raises OSError when it cannot be written."""
    save_text(path, [json.dumps(doc, separators=(",", ":"))])


def save_text(path: str, chunks: Iterable[str]) -> None:
    """``save`` of a document already encoded, in pieces (written as they come). Raises OSError."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for chunk in chunks:
                f.write(chunk)
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


def load(path: str, what: str, version: int) -> dict[str, Any] | None:
    """The document, or None when there is no file.

    Raises ValueError when the file is unreadable, not JSON, or not a ``what`` of ``version``."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != version:
        raise ValueError(f"{path}: not a {what} (version {version})")
    return doc
