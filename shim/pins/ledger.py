"""The pin ledger: the one record of which image sets pin which images on this node.

An entry is one set (by name: set names are unique across sources) with the source that
declared it (``file`` or ``cluster``), where it came from (the file's path, or the object's
kind and uid), its generation and the normalized references of its last valid version that
pins. The pins in force are the union of the entries (``snapshot``), and nothing else.

An entry changes only two ways:
- ``put``: a newer valid version of the set replaces it (a version that no longer pins
  replaces it with nothing, and the entry goes);
- ``drop``: the set's source confirmed that the set is gone (the file is gone from a directory
  that was read, or its valid content no longer declares the set; the object deleted or no
  longer selecting this node in a successful read of the API).
A refusal (``max_images``, an invalid name, a missing secret), an unreachable source, a
restart, a reload, a changed ``image_sets.state_file``, a failed save or a lost state file
is none of these, so it never removes an entry. Which version is "newer": for the same
object (same uid) a lower generation never replaces a higher one (a stale state file read
at start); otherwise the version a source read last.

The ledger is saved to ``pins.ledger_file`` (atomically: a temp file, fsync, rename) after
every change, one save at a time, and loaded before the shim serves its first call. A save
that fails is retried; the entries stay in memory meanwhile and ``error`` says why.

The index (``DeclaredPins``) is edited by the change: replacing an entry costs the names that
changed, whatever the number of pins on the node.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .. import statefile
from ..observability import logs
from .declared_pins import DeclaredPins, PinsSnapshot

_log = logs.get("pins")
WHAT = "cri-shim pin ledger"
_CHUNK = 1000  # names encoded at a time when saving
VERSION = 1


@dataclass(frozen=True)
class Entry:
    """One set's pins: the references (normalized, each once) of its last valid version."""

    name: str
    source: str  # "file", or the source's name ("cluster")
    origin: str  # the file's path, or "<Kind>/<name>" of the object
    uid: str  # the object's metadata.uid ("" for files)
    generation: str
    refs: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "origin": self.origin, "uid": self.uid,
                "generation": self.generation, "refs": list(self.refs)}

    @classmethod
    def from_json(cls, doc: Any) -> Entry:
        """Raises ValueError when ``doc`` is not an entry."""
        if not isinstance(doc, dict):
            raise ValueError("an entry is not an object")
        fields = {k: doc.get(k) for k in ("name", "source", "origin", "uid", "generation")}
        refs = doc.get("refs")
        if (not all(isinstance(v, str) for v in fields.values()) or not fields["name"]
                or not fields["source"]
                or not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs)):
            raise ValueError(f"entry {str(doc.get('name'))[:80]!r} is malformed")
        return cls(refs=tuple(dict.fromkeys(refs)), **fields)  # type: ignore[arg-type]


def _older(new_generation: str, old_generation: str) -> bool:
    """Whether a generation is below another (both numbers: the same object's metadata.generation)."""
    return new_generation.isdigit() and old_generation.isdigit() and int(new_generation) < int(old_generation)


class PinLedger:
    """The node's pins by set. ``path`` "": kept in memory only (tests, or pins.ledger_file off)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._entries: dict[str, Entry] = {}
        self._index = DeclaredPins()
        self._pinned_at: dict[str, int] = {}  # set -> the index version from which its refs are all in
        self.version = 0  # moves at every change of an entry
        self.error = ""  # why the ledger file cannot be read or written; "" once a save succeeded
        self.save_failures = 0
        self.loaded = 0  # entries read from the file at start
        self._saved_version = 0
        self._saving: asyncio.Task[None] | None = None
        self._retry_seconds = 1.0

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def snapshot(self) -> PinsSnapshot:
        """ref -> the set protecting it: the pins in force (costs the changes since the last base)."""
        return self._index.snapshot()

    def covers(self, pins: object, name: str, generation: str) -> bool:
        """Whether ``pins`` (a snapshot of this ledger) holds every ref of ``name`` at ``generation``."""
        e = self._entries.get(name)
        at = self._pinned_at.get(name)
        return (e is not None and at is not None and e.generation == generation and isinstance(pins, PinsSnapshot)
                and pins.index is self._index and pins.version >= at)

    # ------------------------------------------------------------------ changing

    def put(self, name: str, source: str, origin: str, uid: str, generation: str, refs: Iterable[str], *,
            pin: bool = True) -> bool:
        """A valid version of a set (its normalized refs) replaces its entry; ``pin`` False: the
        version does not pin, and the entry goes. A lower generation of the same object than the
        entry's is ignored. True when the ledger changed."""
        old = self._entries.get(name)
        if old is not None and uid and old.uid == uid and _older(generation, old.generation):
            return False
        if not pin:
            return self._remove(name, "a newer version of the set does not pin")
        new = Entry(name, source, origin, uid, generation, tuple(dict.fromkeys(refs)))
        if old == new:
            return False
        if old is None:
            self._index.add(name, new.refs)
        elif old.refs != new.refs:
            olds, news = set(old.refs), set(new.refs)
            self._index.remove(name, olds - news)
            self._index.add(name, [r for r in new.refs if r not in olds])
        self._entries[name] = new
        self._pinned_at[name] = self._index.version
        self._changed()
        if old is None or old.generation != new.generation or old.uid != new.uid:
            logs.log(_log, logging.INFO, "pin ledger: set pinned", set=name, source=source, generation=generation,
                     images=len(new.refs), replaced=old.generation if old is not None else "")
        return True

    def drop(self, name: str, source: str, why: str) -> bool:
        """The set's source confirmed it is gone: its entry goes. True when the ledger changed."""
        e = self._entries.get(name)
        if e is None or e.source != source:
            return False
        return self._remove(name, why)

    def _remove(self, name: str, why: str) -> bool:
        e = self._entries.pop(name, None)
        if e is None:
            return False
        self._index.remove(name, e.refs)
        self._pinned_at.pop(name, None)
        self._changed()
        logs.log(_log, logging.INFO, "pin ledger: set unpinned", set=name, source=e.source, generation=e.generation,
                 images=len(e.refs), why=why)
        return True

    def _changed(self) -> None:
        self.version += 1

    # ------------------------------------------------------------------ the file

    def load(self) -> None:
        """At start, before serving: the entries saved last. An unreadable or malformed file is
        an error (``error``, the log) and loads nothing; the sources declare their sets again."""
        if not self.path:
            return
        try:
            doc = statefile.load(self.path, WHAT, VERSION)
            entries = [Entry.from_json(e) for e in (doc or {}).get("entries", [])]
        except ValueError as e:
            self.error = f"{e}"
            logs.log(_log, logging.ERROR, "pin ledger unusable; the image sets declare their pins again as they are "
                     "read (a set whose file or object is invalid by then is not pinned until it is valid)",
                     file=self.path, error=self.error)
            return
        self.merge(entries)
        self.loaded = len(entries)
        self._saved_version = self.version
        if entries:
            logs.log(_log, logging.INFO, "pin ledger loaded", file=self.path, sets=len(entries),
                     images=len(self._index))
        try:
            statefile.probe(self.path)
        except OSError as e:
            self._failed(e)

    def merge(self, entries: Iterable[Entry]) -> None:
        """Entries of a set not in the ledger are added (a ledger file read at start, or at a reload
        that moved pins.ledger_file); the ledger's own entries win."""
        for e in entries:
            if e.name not in self._entries:
                self.put(e.name, e.source, e.origin, e.uid, e.generation, e.refs)

    def relocate(self, path: str) -> None:
        """A reload changed pins.ledger_file: the entries there are merged in, and all are saved there."""
        if path == self.path:
            return
        old, self.path = self.path, path
        if path:
            try:
                doc = statefile.load(path, WHAT, VERSION)
                self.merge(Entry.from_json(e) for e in (doc or {}).get("entries", []))
            except ValueError as e:
                logs.log(_log, logging.WARNING, "pin ledger: the new file is unusable; overwritten with the pins in "
                         "force", file=path, error=str(e))
        self._saved_version = -1 if self._entries else self.version  # nothing to keep: no file written
        logs.log(_log, logging.INFO, "pin ledger moved", old=old, new=path, sets=len(self._entries))

    def _chunks(self) -> Iterator[str]:
        """The document in pieces of at most ``_CHUNK`` names: a 20,000-name set is encoded in
        short steps, so the thread that saves never holds the GIL for long (relayed calls wait on it)."""
        yield f'{{"version":{VERSION},"entries":['
        for i, e in enumerate(list(self._entries.values())):
            head = json.dumps({k: v for k, v in e.as_json().items() if k != "refs"}, separators=(",", ":"))
            yield ("," if i else "") + head[:-1] + ',"refs":['
            for at in range(0, len(e.refs), _CHUNK):
                yield ("," if at else "") + json.dumps(e.refs[at:at + _CHUNK], separators=(",", ":"))[1:-1]
            yield "]}"
        yield "]}"

    def save_now(self) -> None:
        """Blocking save (a thread, or tests). Raises OSError."""
        version = self.version
        statefile.save_text(self.path, self._chunks())
        self._saved_version = version

    @property
    def unsaved(self) -> bool:
        return bool(self.path) and self._saved_version != self.version

    def schedule_save(self) -> None:
        """Save soon (on the running loop), one save at a time; returns at once."""
        if not self.unsaved or (self._saving is not None and not self._saving.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next change or flush saves
        self._saving = loop.create_task(self._save_loop(), name="pin-ledger-save")

    async def _save_loop(self) -> None:
        while self.unsaved:
            try:
                await asyncio.to_thread(self.save_now)
            except OSError as e:
                self._failed(e)
                await asyncio.sleep(self._retry_seconds)
                self._retry_seconds = min(self._retry_seconds * 2, 30.0)
                continue
            if self.error:
                logs.log(_log, logging.INFO, "pin ledger saved again", file=self.path)
            self.error = ""
            self._retry_seconds = 1.0

    def _failed(self, e: OSError) -> None:
        self.save_failures += 1
        error = f"{self.path}: cannot write: {e.strerror or e}"
        if error != self.error:
            logs.log(_log, logging.ERROR, "cannot save the pin ledger; the pins stay in force in memory and the save "
                     "is tried again (under systemd the unit needs StateDirectory=cri-shim)", error=error)
        self.error = error

    async def flush(self) -> None:
        """Wait for the save under way (shutdown), and try once more if one is owed."""
        if self._saving is not None:
            self._saving.cancel()
            await asyncio.gather(self._saving, return_exceptions=True)
            self._saving = None
        if self.unsaved:
            try:
                await asyncio.to_thread(self.save_now)
            except OSError as e:
                self._failed(e)
                return
            self.error = ""

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.path, "sets": len(self._entries), "images": len(self._index)}
        if self.loaded:
            out["loaded"] = self.loaded
        if self.error:
            out["error"] = self.error
        if self.save_failures:
            out["save_failures"] = self.save_failures
        return out

