"""The last valid content of each file in ``image_sets.dir``, on the node's disk
(``image_sets.state_file``).

Saved (atomically, shim/statefile.py) when the content in force of a file changes: a file
accepted with new content, or deleted; not when a file is only touched or turns invalid.
Read once at start, before the shim serves: a file that is invalid or unreadable at start
then has its last valid version in force (and says so), as it would have had without the
restart; a file that is gone at start is a deletion. It holds the files' text as it was
accepted (each at most ``image_sets.max_file_bytes``), never a credential.
"""

from __future__ import annotations

import json
from typing import Iterator

from .. import statefile
from ..statefile import probe

__all__ = ["VERSION", "load", "probe", "save"]

VERSION = 1
WHAT = "cri-shim image-set file state file"


def save(path: str, files: dict[str, str]) -> None:
    """``files``: path -> the text in force. Raises OSError. Called in a thread: each file's text
    is encoded on its own (one C call per file, bounded by image_sets.max_file_bytes), so ten
    files of 10,000 images never hold the GIL in one 5 MB piece."""
    statefile.save_text(path, _chunks(files))


def _chunks(files: dict[str, str]) -> Iterator[str]:
    yield f'{{"version":{VERSION},"files":{{'
    for i, (p, text) in enumerate(files.items()):
        yield ("," if i else "") + json.dumps(p) + ":" + json.dumps(text)
    yield "}}"


def load(path: str) -> dict[str, str] | None:
    """path -> the last valid text, or None when there is no state file.

    Raises ValueError when it is unreadable or not ours."""
    doc = statefile.load(path, WHAT, VERSION)
    if doc is None:
        return None
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"{path}: not a {WHAT}: \"files\" is not a map of path to text")
    return dict(files)
