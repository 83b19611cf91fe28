"""The parsed versions of the cluster's set objects, made off the event loop and kept by object.

An ``ImageSet`` of 4,000 images is about 25 ms of CPU to turn into a set (every name normalized);
done on the event loop for every object at every change, 25 of them held kubelet's relayed
calls for most of a second. So:

* ``prepare`` (awaited by the apply loop before it selects) parses each object whose
  ``(uid, resourceVersion)`` is not the one parsed last, in the image-set parser child
  (shim/imagesets/parse_process.py: another process, niced, so the relay never waits on it;
  in a thread when the child cannot be started). The child keeps the normalized names of the
  last object it read, so an edit of a large set normalizes only the names it adds.
* ``parsed`` (what selection.py calls) answers from what was prepared: the same ``ImageSet``
  object for an unchanged version, so everything downstream (the reconciler's table, the pin
  ledger) sees the change alone by identity. An object not prepared (the state file's at
  start, before the shim serves; one changed since ``prepare``) is parsed where it is asked.
* An object gone from the API server is forgotten at the next ``prepare``: the cache holds
  at most the objects the informers hold.

The parse does not depend on the node's labels: only which sets are selected does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

from ..imagesets.loader import ImageSet, SetFileError, parse_document


class DocumentParser(Protocol):
    def parse_document(self, doc: dict[str, Any], where: str, source: str,
                       previous: Sequence[ImageSet] = ()) -> ImageSet: ...


@dataclass(frozen=True)
class _Parsed:
    version: tuple[str, str]  # (uid, resourceVersion) of the object parsed
    result: ImageSet | str  # the set, or the SetFileError message


def _version(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = obj.get("metadata") or {}
    rv = meta.get("resourceVersion")
    return (str(meta.get("uid", "")), str(rv)) if rv else None


class Parses:
    """Parsed set documents by key (``objects.source_of``: ``cluster:<Kind>/<name>``)."""

    def __init__(self, parser: DocumentParser | None = None) -> None:
        self._parser = parser
        self._by_key: dict[str, _Parsed] = {}
        self.parsed = 0  # documents parsed (prepared or in place)
        self.reused = 0  # answers from a version parsed before

    def __len__(self) -> int:
        return len(self._by_key)

    def _fresh(self, key: str, obj: Mapping[str, Any]) -> _Parsed | None:
        version = _version(obj)
        p = self._by_key.get(key)
        return p if p is not None and version is not None and p.version == version else None

    async def prepare(self, docs: Iterable[tuple[str, Mapping[str, Any], dict[str, Any], str]]) -> None:
        """``docs``: (key, object, its set document, where) of every set object the API server holds
        now. Parses the new versions off the loop; forgets the keys not given."""
        todo = []
        keep = set()
        for key, obj, doc, where in docs:
            keep.add(key)
            if self._fresh(key, obj) is None and _version(obj) is not None:
                todo.append((key, obj, doc, where))
        for key in self._by_key.keys() - keep:
            del self._by_key[key]
        for key, obj, doc, where in todo:
            version = _version(obj)
            assert version is not None
            old = self._by_key.get(key)
            previous = (old.result,) if old is not None and isinstance(old.result, ImageSet) else ()
            try:
                if self._parser is not None:
                    result: ImageSet | str = await asyncio.to_thread(self._parser.parse_document, doc, where, key,
                                                                     previous)
                else:
                    result = await asyncio.to_thread(parse_document, doc, where, key)
            except SetFileError as e:
                result = str(e)
            self.parsed += 1
            self._by_key[key] = _Parsed(version, result)

    def parsed_set(self, key: str, obj: Mapping[str, Any], doc: dict[str, Any], where: str) -> ImageSet:
        """The set of ``obj`` (its document ``doc``); raises SetFileError as ``parse_document`` does."""
        p = self._fresh(key, obj)
        if p is None:
            try:
                result: ImageSet | str = parse_document(doc, where, key)
            except SetFileError as e:
                result = str(e)
            self.parsed += 1
            version = _version(obj)
            if version is not None:
                p = self._by_key[key] = _Parsed(version, result)
            elif isinstance(result, str):
                raise SetFileError(result)
            else:
                return result
        else:
            self.reused += 1
        if isinstance(p.result, str):
            raise SetFileError(p.result)
        return p.result
