"""The images of every declared set in force, where each one stands, and the counts per set.

Each declared image is one ``DeclaredImage``, keyed by its reference and its declared runtime
handler. Two rules keep the counts true without ever counting again:

- an image's state changes only in ``set_state`` (``record_failure``, ``mark_present`` and
  ``queue_up`` go through it), which moves the image between the counts of each of its sets
  and the totals;
- the sets change only in ``apply``: a set equal to the one in force costs nothing, an edited
  one is diffed against its previous version (``diff_versions``), and a set that would take
  the node over ``image_sets.max_images`` is refused while its previous version stays.

Nothing here does I/O or waits: the reconciler (reconciler.py) drives the table.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Container, Hashable, Iterable, Sequence, TypeVar

from ..observability import logs
from ..pulls.failure import PullFailure
from ..reference import split_domain
from .loader import ImageSet
from .snapshot import State

_log = logs.get("imagesets")

ImageKey = tuple[str, str]  # (canonical ref, declared runtime handler)
EDIT_SCAN_MIN = 64  # names added by an edit above which one pass over the new set finds their places


@dataclass(eq=False, slots=True)
class DeclaredImage:
    """One declared image: about 270 bytes with its key tuple and index entries (docs/image-sets.md)."""
    ref: str  # canonical
    spelled: str  # as first declared: what is pulled (so a kubelet pull of the same string collapses)
    sets: tuple[str, ...]  # names of the sets that declare it
    handler: str = ""  # declared by its set(s); "" = a matching rule's, if any
    state: State = State.UNKNOWN
    since: float = 0.0  # clock when state last changed
    attempts: int = 0
    retry_at: float = 0.0
    failure: PullFailure | None = None  # the last failed pull's code and details, as the runtime gave them
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # its prefetch, while one runs

    @property
    def key(self) -> ImageKey:
        return (self.ref, self.handler)

    @property
    def host(self) -> str:
        """Its registry host (the retry budget is kept per host)."""
        return split_domain(self.ref)[0]

    @property
    def error(self) -> str:
        return str(self.failure) if self.failure is not None else ""

    @property
    def reason(self) -> str:
        """The last failure's typed reason (pulls/failure.py REASONS)."""
        return self.failure.reason if self.failure is not None else "other"


class SetCounts:
    """One set's images by state, the reasons of its failed ones, and its images with a failure."""
    __slots__ = ("by_state", "reasons", "errored", "pinned")

    def __init__(self) -> None:
        self.by_state = [0] * len(State)
        self.reasons: Counter[str] = Counter()  # of its FAILED images
        self.errored: dict[DeclaredImage, None] = {}  # its images with a failure, most recent last
        self.pinned: tuple[object, str, int] | None = None  # (pins object, generation, pinned count): report.py

    def forget_reason(self, reason: str) -> None:
        self.reasons[reason] -= 1
        if self.reasons[reason] <= 0:
            del self.reasons[reason]


def set_keys(s: ImageSet) -> list[ImageKey]:
    """The keys of a set's images, in file order."""
    return list(zip(s.refs, s.handlers or ("",) * len(s.refs)))


def diff_versions(old: ImageSet, new: ImageSet) -> tuple[list[ImageKey], list[tuple[ImageKey, str]]]:
    """What an edit of a set changes: the keys ``new`` drops, and (key, spelled) of those it adds,
    in file order. Set and dict operations on the references (on (reference, handler) only when a
    handler is declared): an edit of 2 names in a set of 10,000 runs no Python loop over the 10,000."""
    if any(old.handlers) or any(new.handlers):
        return _diff(set_keys(old), set_keys(new), new.spelled)
    gone, added = _diff(old.refs, new.refs, new.spelled)
    return [(r, "") for r in gone], [((r, ""), spelled) for r, spelled in added]


_K = TypeVar("_K", bound=Hashable)


def _diff(old: Sequence[_K], new: Sequence[_K], spelled: Sequence[str]) -> tuple[list[_K], list[tuple[_K, str]]]:
    olds, news = set(old), set(new)
    added = news - olds
    if len(added) <= EDIT_SCAN_MIN:  # a few: one C scan of ``new`` each finds where
        at = sorted(map(new.index, added))
    else:
        at = [i for i, k in enumerate(new) if k in added]
    return list(olds - news), [(new[i], spelled[i]) for i in at]


class ImageTable:
    """The declared sets in force, their images and the counts kept as images change state."""

    def __init__(self) -> None:
        self.sets: dict[str, ImageSet] = {}  # the versions in force (a refused edit keeps the previous one)
        self._images: dict[ImageKey, DeclaredImage] = {}
        self._handlers_of: dict[str, set[str]] = {}  # ref -> its non-empty declared handlers (rare)
        self._counts: dict[str, SetCounts] = {}
        self._shared: dict[tuple[str, ...], tuple[str, ...]] = {}  # interned DeclaredImage.sets values
        self.totals = [0] * len(State)
        self.declared = 0  # entries summed over the sets in force (image_sets.max_images)
        self.refused: dict[str, tuple[str, str]] = {}  # set -> (generation refused, why)
        self.unknown: dict[DeclaredImage, None] = {}  # declared since the last pass, in declaration order
        self._waiting: deque[DeclaredImage] = deque()  # queued for a lane, oldest first (dropped ones skipped)
        self.changed: set[str] = set()  # sets whose gauges / progress line are due (report.py)
        self.removed: set[str] = set()  # removed sets whose gauge series are to be dropped (report.py)

    def __len__(self) -> int:
        """The distinct declared images (an image in two sets counts once)."""
        return len(self._images)

    def counts(self, name: str) -> SetCounts:
        return self._counts[name]

    def is_current(self, img: DeclaredImage) -> bool:
        """Whether ``img`` is still declared (not dropped from every set since it was looked up)."""
        return self._images.get(img.key) is img

    def mark_all_changed(self) -> None:
        """Every set's report is due (the disk guard or the runtime's state changed)."""
        self.changed.update(self.sets)

    # ------------------------------------------------------------------ the sets

    def apply(self, sets: dict[str, ImageSet], first: Container[str], max_images: int, now: float) -> None:
        """The declared sets changed. Costs the change: a set equal to the one in force costs
        nothing; an added, edited or removed set costs its size. ``first``: sets that keep their
        room under ``max_images`` before any other: a newcomer is refused before one of them."""
        for name in [n for n in self.sets if n not in sets]:
            gone = self.sets.pop(name)
            for key in set_keys(gone):
                self._leave(key, name)
            self.declared -= len(gone.refs)
            del self._counts[name]
            self.changed.discard(name)
            self.removed.add(name)
            logs.log(_log, logging.INFO, "image set removed; its images stay until kubelet GC removes them",
                     set=name)
        for name in [n for n in self.refused if n not in sets]:
            del self.refused[name]
        for name in sorted(sets, key=lambda n: (n not in first, n)):
            s = sets[name]
            old = self.sets.get(name)
            if old is s or old == s:
                self.refused.pop(name, None)
                continue
            total = self.declared - (len(old.refs) if old is not None else 0) + len(s.refs)
            if total > max_images:
                self._refuse(s, old, total, max_images)
                continue
            if self.refused.pop(name, None) is not None:
                logs.log(_log, logging.INFO, "image set accepted again", set=name, generation=s.generation)
            self._put(s, old, now)

    def _refuse(self, s: ImageSet, old: ImageSet | None, total: int, max_images: int) -> None:
        why = (f"{s.source}: set {s.name!r} generation {s.generation} declares {len(s.refs)} images; with the "
               f"other sets that is {total}, above image_sets.max_images {max_images}; "
               + (f"generation {old.generation} stays in force" if old is not None else "not applied"))
        if self.refused.get(s.name) != (s.generation, why):
            logs.log(_log, logging.ERROR, "image set refused: too many images declared on this node", set=s.name,
                     generation=s.generation, images=len(s.refs), declared=total, max_images=max_images,
                     kept=old.generation if old is not None else "")
        self.refused[s.name] = (s.generation, why)

    def _put(self, s: ImageSet, old: ImageSet | None, now: float) -> None:
        name = s.name
        logs.log(_log, logging.INFO, "image set loaded", set=name, kind=s.kind, generation=s.generation,
                 images=len(s.refs), pin=s.pin, file=s.source)
        if s.ignored:
            logs.log(_log, logging.INFO, "image set fields ignored on a single node", set=name,
                     fields=",".join(s.ignored))
        if old is not None:
            gone, added = diff_versions(old, s)  # costs the change, not the set
            for key in gone:
                self._leave(key, name)
            self.declared -= len(old.refs)
        else:
            self._counts[name] = SetCounts()
            added = list(zip(set_keys(s), s.spelled))
        for key, spelled in added:
            self._join(key, spelled, name, now)
        self.declared += len(s.refs)
        self._counts[name].pinned = None
        self.sets[name] = s
        self.changed.add(name)

    def _join(self, key: ImageKey, spelled: str, name: str, now: float) -> None:
        img = self._images.get(key)
        if img is None:
            img = self._images[key] = DeclaredImage(key[0], spelled, (), handler=key[1], since=now)
            if key[1]:
                self._handlers_of.setdefault(key[0], set()).add(key[1])
            self.totals[State.UNKNOWN] += 1
            self.unknown[img] = None
        img.sets = self._shared_names((*img.sets, name))
        counts = self._counts[name]
        counts.by_state[img.state] += 1
        if img.state is State.FAILED:
            counts.reasons[img.reason] += 1
        if img.failure is not None:
            counts.errored[img] = None

    def _leave(self, key: ImageKey, name: str) -> None:
        """``name`` no longer declares the image of ``key``; declared by no set, it is forgotten
        and its prefetch, if one runs, is cancelled."""
        img = self._images[key]
        img.sets = self._shared_names(tuple(n for n in img.sets if n != name))
        counts = self._counts[name]
        counts.by_state[img.state] -= 1
        if img.state is State.FAILED:
            counts.forget_reason(img.reason)
        counts.errored.pop(img, None)
        if img.sets:
            return
        del self._images[key]
        self.totals[img.state] -= 1
        self.unknown.pop(img, None)
        if key[1]:
            handlers = self._handlers_of[key[0]]
            handlers.discard(key[1])
            if not handlers:
                del self._handlers_of[key[0]]
        if img.task is not None:
            img.task.cancel()
            logs.log(_log, logging.INFO, "image dropped from its sets; prefetch cancelled", image=key[0],
                     handler=key[1])

    def _shared_names(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """One shared tuple per combination of set names (most images share a handful)."""
        if len(self._shared) > 4 * len(self.sets) + 1024:
            self._shared.clear()  # combinations of sets long gone: start over (images keep theirs)
        return self._shared.setdefault(names, names)

    def images_named(self, ref: str) -> Iterable[DeclaredImage]:
        """The declared images (one per declared handler) of a normalized name."""
        img = self._images.get((ref, ""))
        if img is not None:
            yield img
        for h in self._handlers_of.get(ref, ()):
            img = self._images.get((ref, h))
            if img is not None:
                yield img

    def unknown_since(self, started: float, limit: int) -> list[DeclaredImage]:
        """The images that became unknown after ``started``, newest last; at most ``limit`` + 1
        (more means a full pass). ``unknown`` is in the order they became unknown."""
        newest: list[DeclaredImage] = []
        for img in reversed(self.unknown):
            if img.since < started or len(newest) > limit:
                break
            newest.append(img)
        newest.reverse()
        return newest

    # ------------------------------------------------------------------ an image's state

    def set_state(self, img: DeclaredImage, state: State, now: float) -> None:
        """The one place an image's state changes: the counts follow."""
        old = img.state
        img.since = now
        if old is state:
            return
        img.state = state
        self.totals[old] -= 1
        self.totals[state] += 1
        for name in img.sets:
            counts = self._counts[name]
            counts.by_state[old] -= 1
            counts.by_state[state] += 1
            if old is State.FAILED:
                counts.forget_reason(img.reason)
            if state is State.FAILED:
                counts.reasons[img.reason] += 1
            self.changed.add(name)
        if state is State.UNKNOWN:
            self.unknown[img] = None
        elif old is State.UNKNOWN:
            self.unknown.pop(img, None)

    def record_failure(self, img: DeclaredImage, failure: PullFailure, now: float, retry_at: float) -> None:
        """A pull of ``img`` failed: note why and when it is retried."""
        img.attempts += 1
        img.failure = failure
        for name in img.sets:
            errored = self._counts[name].errored
            errored.pop(img, None)
            errored[img] = None  # most recent last
        img.retry_at = retry_at
        self.set_state(img, State.FAILED, now)

    def mark_present(self, img: DeclaredImage, now: float) -> None:
        self.set_state(img, State.PRESENT, now)
        if img.failure is not None:
            for name in img.sets:
                self._counts[name].errored.pop(img, None)
        img.attempts, img.failure = 0, None

    # ------------------------------------------------------------------ the images waiting for a lane

    def queue_up(self, img: DeclaredImage, now: float) -> None:
        self.set_state(img, State.QUEUED, now)
        self._waiting.append(img)

    @property
    def waiting(self) -> bool:
        """Whether anything is queued (dropped images not skipped yet included)."""
        return bool(self._waiting)

    def next_waiting(self) -> DeclaredImage | None:
        """The oldest image still queued (dropped ones are skipped for good), left in the queue."""
        while self._waiting:
            img = self._waiting[0]
            if self.is_current(img) and img.state is State.QUEUED:
                return img
            self._waiting.popleft()
        return None

    def take_waiting(self) -> DeclaredImage:
        """The oldest image queued (after ``next_waiting`` returned it), out of the queue."""
        return self._waiting.popleft()

    def unqueue(self, now: float) -> None:
        """Every queued image back to unknown (halt: the next pass decides again)."""
        for img in self._waiting:
            if img.state is State.QUEUED and self.is_current(img):
                self.set_state(img, State.UNKNOWN, now)
        self._waiting.clear()
