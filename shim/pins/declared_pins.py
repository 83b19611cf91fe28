"""The pins the image sets in force declare, kept as the sets change.

Each pinned image (its normalized reference) maps to the sets that pin it, in the order they
pinned it; the first of them is the one an operator is told protects the image. Adding or
removing a set's names costs those names: an edit of 10 names in a pinned set of 10,000 touches
10 entries, whatever the number of pinned images on the node.

``snapshot()`` is what the image service keeps while the sets move on: an immutable Mapping,
ref -> set. Copying 100,000 entries at every edit would cost about 10 ms of the event loop, so a
snapshot is a shared base (a dict frozen when it was made) plus a copy of the changes since
(``_changes``: ref -> set, or None for a ref no longer pinned). The base is made again from the
live index once the changes outgrow ``COMPACT_MIN`` entries and a quarter of the base: a
snapshot costs the changes since the last base, and a new base costs the index once per that
many changed names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Iterable

COMPACT_MIN = 4096  # changed names kept beside the base before a new base is made (and a quarter of the base)
_ABSENT = object()


class PinsSnapshot(Mapping[str, str]):
    """ref -> the set pinning it, as of when it was taken. Never changes. ``index`` and
    ``version``: the DeclaredPins it was taken from and its version then (every name a set had
    pinned by that version is in it)."""

    __slots__ = ("_base", "_changes", "_len", "index", "version")

    def __init__(self, base: dict[str, str], changes: dict[str, str | None], length: int,
                 index: DeclaredPins, version: int) -> None:
        self._base, self._changes, self._len = base, changes, length
        self.index, self.version = index, version

    def get(self, ref: str, default: str | None = None) -> str | None:  # type: ignore[override]
        v = self._changes.get(ref, _ABSENT)
        if v is _ABSENT:
            return self._base.get(ref, default)
        return default if v is None else v  # type: ignore[return-value]

    def __getitem__(self, ref: str) -> str:
        v = self.get(ref)
        if v is None:
            raise KeyError(ref)
        return v

    def __contains__(self, ref: object) -> bool:
        v = self._changes.get(ref, _ABSENT)  # type: ignore[call-overload]
        return ref in self._base if v is _ABSENT else v is not None

    def __iter__(self) -> Iterator[str]:
        changes = self._changes
        yield from (r for r in self._base if r not in changes)
        yield from (r for r, v in changes.items() if v is not None)

    def __len__(self) -> int:
        return self._len


class DeclaredPins:
    """The live index the reconciler edits (``add``, ``remove``) and snapshots (``snapshot``)."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}  # ref -> the first set pinning it (live)
        self._more: dict[str, list[str]] = {}  # ref -> the other sets pinning it (rare: a ref in two pinning sets)
        self._base: dict[str, str] = {}  # shared with snapshots: never changed once made
        self._changes: dict[str, str | None] = {}  # owner changes since _base was made (None: unpinned)
        self.version = 0  # moves at every change

    def __len__(self) -> int:
        return len(self._owner)

    def _record_owner(self, ref: str, set_name: str | None) -> None:
        """The set pinning ``ref`` is now ``set_name`` (None: no set): a change the next snapshot carries."""
        self._changes[ref] = set_name
        self.version += 1

    def add(self, set_name: str, refs: Iterable[str]) -> None:
        """``set_name`` pins ``refs`` (normalized, each at most once per set)."""
        owner, more = self._owner, self._more
        for ref in refs:
            first = owner.setdefault(ref, set_name)
            if first != set_name:
                more.setdefault(ref, []).append(set_name)
            else:
                self._record_owner(ref, set_name)

    def remove(self, set_name: str, refs: Iterable[str]) -> None:
        """``set_name`` no longer pins ``refs``; another set pinning one of them keeps it pinned."""
        owner, more = self._owner, self._more
        for ref in refs:
            rest = more.get(ref)
            if owner.get(ref) == set_name:
                if rest:
                    owner[ref] = rest.pop(0)
                    self._record_owner(ref, owner[ref])
                else:
                    del owner[ref]
                    self._record_owner(ref, None)
            elif rest and set_name in rest:
                rest.remove(set_name)
            else:
                continue
            if rest is not None and not rest:
                del more[ref]

    def snapshot(self) -> PinsSnapshot:
        """ref -> the set that protects it, as of now (see the module's docstring for the cost)."""
        if len(self._changes) > max(COMPACT_MIN, len(self._base) // 4):
            self._base, self._changes = dict(self._owner), {}
        return PinsSnapshot(self._base, dict(self._changes), len(self._owner), self, self.version)
