"""Keeping declared image sets present: diff against the runtime, pull only the difference.

A pass reads the runtime's images (ListImages) and compares the names it holds with the
names of the last pass: only images whose name appeared or went, and images declared
since, change state. A few newly declared images (up to ``PROBE_MAX``) are looked up
one by one with ImageStatus instead, so adding ten images to a 20,000-image set costs ten
lookups, not a list of the whole runtime. A full pass still runs every ``RESYNC_SECONDS``
(GC, crictl rmi), as a task of its own: images declared while it is on its way (a 100,000-image
list takes about half a second) are looked up at once, not after it, and what the list says
never overrides a state decided after it was asked for. Pulls go through the node-wide
scheduler at background priority, at most ``image_sets.max_parallel`` of ours at a time; each
lane pauses ``cooldown_seconds`` after a pull. Before each pull starts, the free space of the
runtime's image filesystem (ImageFsInfo mountpoint + statvfs) is checked against
``min_free_bytes``; when short, nothing new starts and status says why.

A failed image is retried after ``retry_initial_seconds``, doubling up to
``retry_max_seconds``; it never holds the others back. Retries wait in a due-time queue
(due.py) and then for a token of their registry host's retry budget
(``image_sets.retry_per_second``, down to a tenth of it while that host's prefetches fail).
An image dropped from every set is forgotten: its queued or running prefetch is cancelled
(the scheduler drops the flight unless a CRI client joined it, whose pull goes on), and the
image itself is left to kubelet's garbage collection. Pins are not decided here: the pin
ledger (ledger.py) keeps them, from the versions this reconciler accepts.

Work costs the change: ``set_sets`` diffs each set whose spec changed against its previous
version (an unchanged set costs nothing, an edited one its size); counts by state per set
and in total are kept as images change state; the loop wakes for what fell due (the heap's
top), never scanning every image. What the reconciler knows is published as a typed
``Snapshot`` (snapshot.py), built per set from those counts.

At most ``image_sets.max_images`` images are declared over all sets (each set's entries
summed). A set that would go beyond is refused (its previous version, if any, stays in
force), with the reason in status and the log: the process never grows toward its memory
limit because of a declaration.

Each pull is for the image's runtime handler: the one its set declares, else the
first ``runtime_handlers.rules`` entry that matches the image without a pod (no
``namespaces``/``pod_labels`` matchers). With a handler the request carries a minimal
``sandbox_config`` (containerd reads the handler only then). Credentials come from the
node's docker config.json files (``image_sets.docker_config``, kubelet's keyring rules);
several matching entries are tried in order, most specific first, as kubelet does.
The scheduler's join rule applies: a prefetch joins a trusted CRI client's pull of the
same image and handler whatever its credentials, never an untrusted client's.

The reconciler's own ListImages, ImageStatus and ImageFsInfo calls have a deadline
(``image_sets.runtime_timeout_seconds``): a runtime that hangs is a failed list, retried
with backoff, never a stuck loop. Each prefetch waits for its pull at most
``image_sets.pull_timeout_seconds`` (queued and running): then it fails and is retried.

Nothing here is on the path of a CRI call: kubelet never waits for a reconcile.

Why one module: every part here (the diff, the lanes, the disk guard, the retry clock, the
per-set counts) reads and writes the same per-image state (``_Image``) under two rules:
only ``_feed`` starts pulls, and only ``_set`` (and ``_join``/``_leave``) change a state,
so the counts stay true. Split across modules, that state would be shared by reference and
the rules would no longer be visible in one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Hashable, Iterable, Mapping, Sequence, TypeVar

import grpc

from ..config import ImageSetsConfig
from ..credentials import Credential, DockerConfigFiles, Keyring
from ..credentials.plugins import PluginProviders, ProviderConfigError
from ..cri.deadline import Deadline
from ..cri.methods import IMAGE_FS_INFO, IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..images.pin_set import PinSet
from ..observability import logs
from ..observability.metrics import Metrics
from ..proto.runtime.v1 import api_pb2
from ..pulls.failure import PullFailure
from ..pulls.key import pull_key
from ..pulls.progress import human_bytes
from ..pulls.scheduler import PullScheduler
from ..pulls.slots import Priority
from ..reference import pull_name, split_domain
from .due import DueQueue, RetryBudget
from .loader import ImageSet
from .snapshot import COUNTED, Counts, SetSnapshot, Snapshot, State

_log = logs.get("imagesets")

RESYNC_SECONDS = 60.0  # re-read the runtime's images this often (GC, crictl rmi)
DISK_RECHECK_SECONDS = 30.0  # while short of space
PROBE_MAX = 64  # up to this many newly declared images: ImageStatus each, not a full ListImages
PROGRESS_STEPS = (25, 50, 75, 100)

HandlerFor = Callable[[str], "tuple[str, str] | None"]  # image -> (handler, where the rule is), or None
SetCredentials = Callable[[frozenset[str]], "list[tuple[str, Credential]]"]  # set names -> their pull secrets' entries
# (the pins in force's declared part, set, generation) -> whether they hold every name of that version (ledger.covers)
PinnedFully = Callable[[Mapping[str, str], str, str], bool]
ImageKey = tuple[str, str]  # (canonical ref, declared runtime handler)
PREFETCH_POD = api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(
    name="cri-shim-prefetch", uid="cri-shim-prefetch", namespace="cri-shim"))


@dataclass(eq=False, slots=True)
class _Image:
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
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> ImageKey:
        return (self.ref, self.handler)

    @property
    def error(self) -> str:
        return str(self.failure) if self.failure is not None else ""

    @property
    def reason(self) -> str:
        """The last failure's typed reason (pulls/failure.py REASONS)."""
        return self.failure.reason if self.failure is not None else "other"


class _Book:
    """One set's counts, kept as its images change state."""
    __slots__ = ("counts", "reasons", "errored", "pinned")

    def __init__(self) -> None:
        self.counts = [0] * len(State)
        self.reasons: Counter[str] = Counter()  # of its FAILED images
        self.errored: dict[_Image, None] = {}  # its images with a failure, most recent last
        self.pinned: tuple[object, str, int] | None = None  # (pins object, generation, pinned count)


def _keys(s: ImageSet) -> list[ImageKey]:
    return list(zip(s.refs, s.handlers or ("",) * len(s.refs)))


def _edit(old: ImageSet, new: ImageSet) -> tuple[list[ImageKey], list[tuple[ImageKey, str]]]:
    """What an edit of a set changes: the keys ``new`` drops, and (key, spelled) of those it adds,
    in file order. Set and dict operations on the references (on (reference, handler) only when a
    handler is declared): an edit of 2 names in a set of 10,000 runs no Python loop over the 10,000."""
    if any(old.handlers) or any(new.handlers):
        return _edit_of(_keys(old), _keys(new), new.spelled)
    gone, added = _edit_of(old.refs, new.refs, new.spelled)
    return [(r, "") for r in gone], [((r, ""), spelled) for r, spelled in added]


_K = TypeVar("_K", bound=Hashable)
EDIT_SCAN_MIN = 64  # names added by an edit above which one pass over the new set finds their places


def _edit_of(old: Sequence[_K], new: Sequence[_K], spelled: Sequence[str]) -> tuple[list[_K], list[tuple[_K, str]]]:
    olds, news = set(old), set(new)
    added = news - olds
    if len(added) <= EDIT_SCAN_MIN:  # a few: one C scan of ``new`` each finds where
        at = sorted(map(new.index, added))
    else:
        at = [i for i, k in enumerate(new) if k in added]
    return list(olds - news), [(new[i], spelled[i]) for i in at]


def _host(img: _Image) -> str:
    return split_domain(img.ref)[0]


async def _wait(event: asyncio.Event, timeout: float) -> None:
    """Wait for ``event`` at most ``timeout`` seconds. (Not asyncio.wait_for: on 3.11 it can
    swallow a cancellation that arrives as the event is set, and the task would never stop.)"""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


class Reconciler:
    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, scheduler: PullScheduler, metrics: Metrics, *,
                 pins: Callable[[], PinSet] | None = None, pinned_fully: PinnedFully | None = None,
                 handler_for: HandlerFor | None = None, credentials: DockerConfigFiles | None = None,
                 set_credentials: SetCredentials | None = None,
                 statvfs: Callable[[str], Any] = os.statvfs, clock: Callable[[], float] = time.monotonic,
                 resync_seconds: float = RESYNC_SECONDS, disk_recheck_seconds: float = DISK_RECHECK_SECONDS) -> None:
        self.cfg = cfg
        self.upstream = upstream
        self.scheduler = scheduler
        self.metrics = metrics
        self._pins = pins
        self._pinned_fully = pinned_fully
        self._handler_for = handler_for
        self.credentials = credentials if credentials is not None else DockerConfigFiles(cfg.docker_config)
        self.set_credentials = set_credentials  # a set's own pull secrets (cluster sets), before the node's
        self.plugins: PluginProviders | None = None
        self._load_plugins(cfg)
        self._statvfs = statvfs
        self._clock = clock
        self.resync_seconds = resync_seconds
        self.disk_recheck_seconds = disk_recheck_seconds

        self.sets: dict[str, ImageSet] = {}  # the versions in force (a refused edit keeps the previous one)
        self._images: dict[ImageKey, _Image] = {}
        self._handlers_of: dict[str, set[str]] = {}  # ref -> its non-empty declared handlers (rare)
        self._books: dict[str, _Book] = {}
        self._tuples: dict[tuple[str, ...], tuple[str, ...]] = {}  # interned _Image.sets values
        self._totals = [0] * len(State)
        self._declared = 0  # entries summed over the sets in force (image_sets.max_images)
        self._refused: dict[str, tuple[str, str]] = {}  # set -> (generation refused, why)
        self._unknown: dict[_Image, None] = {}  # declared since the last pass, in declaration order
        self._present: set[str] = set()  # every normalized name the runtime had at the last pass
        self._queue: deque[_Image] = deque()
        self._due: DueQueue[_Image] = DueQueue()
        self._budget: RetryBudget[_Image] = RetryBudget(cfg.retry_per_second)
        self._lanes: dict[asyncio.Task[None], _Image] = {}
        self._wake = asyncio.Event()
        self._need_list = True
        self._listing: asyncio.Task[None] | None = None  # the full pass on its way
        self._list_started = 0.0
        self._probe_failed_at = 0.0  # a lookup while the full pass is on its way failed: not again until it lands
        self._list_failures = 0
        self._next_list = 0.0
        self._progress: dict[str, tuple[str, int]] = {}  # set -> (generation, last step logged)
        self._dirty: set[str] = set()  # sets whose gauges / progress line are due
        self._gone: set[str] = set()  # removed sets whose gauge series are to be dropped
        self._norm_cache: dict[str, str] = {}

        self.runtime_error = ""
        self.disk_blocked = ""
        self._disk_checked_at = 0.0
        self._mounts: list[str] = []
        self._fs_error = ""
        self.free_bytes: int | None = None
        self.last_pass: dict[str, Any] = {}
        self.passes = 0
        self.pulls_started = 0

    # ------------------------------------------------------------------ inputs

    def configure(self, cfg: ImageSetsConfig) -> None:
        self.cfg = cfg
        self._budget.configure(cfg.retry_per_second)
        self.credentials.configure(cfg.docker_config)
        self._load_plugins(cfg)
        self._wake.set()

    def _load_plugins(self, cfg: ImageSetsConfig) -> None:
        """(Re-)read the CredentialProviderConfig: at start and at every reload. A file that
        turned bad since the config was validated keeps the running providers."""
        if not cfg.credential_provider_config:
            self.plugins = None
            return
        try:
            self.plugins = PluginProviders.from_files(cfg.credential_provider_config, cfg.credential_provider_bin_dir)
        except ProviderConfigError as e:
            logs.log(_log, logging.ERROR, "credential provider config rejected; keeping the running providers",
                     error=str(e))

    def set_sets(self, sets: dict[str, ImageSet], first: Container[str] = ()) -> None:
        """The declared sets changed. Costs the change: a set equal to the one in force costs
        nothing; an added, edited or removed set costs its size. Newly declared images are
        looked up (ImageStatus or one ListImages); what is no longer declared is cancelled.
        ``first``: sets that keep their room under ``max_images`` before any other (the pin
        ledger's): a newcomer is refused before one of them, at a restart too."""
        now = self._clock()
        for name in [n for n in self.sets if n not in sets]:
            gone = self.sets.pop(name)
            for key in _keys(gone):
                self._leave(key, name)
            self._declared -= len(gone.refs)
            del self._books[name]
            self._progress.pop(name, None)
            self._dirty.discard(name)
            self._gone.add(name)
            logs.log(_log, logging.INFO, "image set removed; its images stay until kubelet GC removes them",
                     set=name)
        for name in [n for n in self._refused if n not in sets]:
            del self._refused[name]
        for name in sorted(sets, key=lambda n: (n not in first, n)):
            s = sets[name]
            old = self.sets.get(name)
            if old is s or old == s:
                self._refused.pop(name, None)
                continue
            total = self._declared - (len(old.refs) if old is not None else 0) + len(s.refs)
            if total > self.cfg.max_images:
                self._refuse(s, old, total)
                continue
            if self._refused.pop(name, None) is not None:
                logs.log(_log, logging.INFO, "image set accepted again", set=name, generation=s.generation)
            self._apply(s, old, now)
        if self._unknown:
            self._need_list = True
        self._wake.set()

    def _refuse(self, s: ImageSet, old: ImageSet | None, total: int) -> None:
        why = (f"{s.source}: set {s.name!r} generation {s.generation} declares {len(s.refs)} images; with the "
               f"other sets that is {total}, above image_sets.max_images {self.cfg.max_images}; "
               + (f"generation {old.generation} stays in force" if old is not None else "not applied"))
        if self._refused.get(s.name) != (s.generation, why):
            logs.log(_log, logging.ERROR, "image set refused: too many images declared on this node", set=s.name,
                     generation=s.generation, images=len(s.refs), declared=total, max_images=self.cfg.max_images,
                     kept=old.generation if old is not None else "")
        self._refused[s.name] = (s.generation, why)

    def _apply(self, s: ImageSet, old: ImageSet | None, now: float) -> None:
        name = s.name
        logs.log(_log, logging.INFO, "image set loaded", set=name, kind=s.kind, generation=s.generation,
                 images=len(s.refs), pin=s.pin, file=s.source)
        if s.ignored:
            logs.log(_log, logging.INFO, "image set fields ignored on a single node", set=name,
                     fields=",".join(s.ignored))
        if old is not None:
            gone, added = _edit(old, s)  # costs the change, not the set
            for key in gone:
                self._leave(key, name)
            self._declared -= len(old.refs)
        else:
            self._books[name] = _Book()
            added = list(zip(_keys(s), s.spelled))
        for key, spelled in added:
            self._join(key, spelled, name, now)
        self._declared += len(s.refs)
        self._books[name].pinned = None
        self.sets[name] = s
        self._dirty.add(name)

    def _join(self, key: ImageKey, spelled: str, name: str, now: float) -> None:
        img = self._images.get(key)
        if img is None:
            img = self._images[key] = _Image(key[0], spelled, (), handler=key[1], since=now)
            if key[1]:
                self._handlers_of.setdefault(key[0], set()).add(key[1])
            self._totals[State.UNKNOWN] += 1
            self._unknown[img] = None
        img.sets = self._tuple((*img.sets, name))
        book = self._books[name]
        book.counts[img.state] += 1
        if img.state is State.FAILED:
            book.reasons[img.reason] += 1
        if img.failure is not None:
            book.errored[img] = None

    def _leave(self, key: ImageKey, name: str) -> None:
        img = self._images[key]
        img.sets = self._tuple(tuple(n for n in img.sets if n != name))
        book = self._books[name]
        book.counts[img.state] -= 1
        if img.state is State.FAILED:
            self._uncount_reason(book, img.reason)
        book.errored.pop(img, None)
        if img.sets:
            return
        del self._images[key]
        self._totals[img.state] -= 1
        self._unknown.pop(img, None)
        if key[1]:
            handlers = self._handlers_of[key[0]]
            handlers.discard(key[1])
            if not handlers:
                del self._handlers_of[key[0]]
        if img.task is not None:
            img.task.cancel()
            logs.log(_log, logging.INFO, "image dropped from its sets; prefetch cancelled", image=key[0],
                     handler=key[1])

    def _tuple(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """One shared tuple per combination of set names (most images share a handful)."""
        if len(self._tuples) > 4 * len(self.sets) + 1024:
            self._tuples.clear()  # combinations of sets long gone: start over (images keep theirs)
        return self._tuples.setdefault(names, names)

    @staticmethod
    def _uncount_reason(book: _Book, reason: str) -> None:
        book.reasons[reason] -= 1
        if book.reasons[reason] <= 0:
            del book.reasons[reason]

    def _named(self, ref: str) -> Iterable[_Image]:
        """The declared images (one per declared handler) of a normalized name."""
        img = self._images.get((ref, ""))
        if img is not None:
            yield img
        for h in self._handlers_of.get(ref, ()):
            img = self._images.get((ref, h))
            if img is not None:
                yield img

    def _set(self, img: _Image, state: State, now: float) -> None:
        """The one place an image's state changes: the counts follow."""
        old = img.state
        img.since = now
        if old is state:
            return
        img.state = state
        self._totals[old] -= 1
        self._totals[state] += 1
        for name in img.sets:
            book = self._books[name]
            book.counts[old] -= 1
            book.counts[state] += 1
            if old is State.FAILED:
                self._uncount_reason(book, img.reason)
            if state is State.FAILED:
                book.reasons[img.reason] += 1
            self._dirty.add(name)
        if state is State.UNKNOWN:
            self._unknown[img] = None
        elif old is State.UNKNOWN:
            self._unknown.pop(img, None)

    def _failed(self, img: _Image, failure: PullFailure, now: float) -> float:
        """A pull failed: note why, schedule the retry. Returns the delay."""
        img.attempts += 1
        img.failure = failure
        for name in img.sets:
            errored = self._books[name].errored
            errored.pop(img, None)
            errored[img] = None  # most recent last
        delay = self._backoff(img.attempts)
        img.retry_at = now + delay
        self._set(img, State.FAILED, now)
        self._due.push(img.retry_at, img)
        return delay

    def _now_present(self, img: _Image, now: float) -> None:
        self._set(img, State.PRESENT, now)
        if img.failure is not None:
            for name in img.sets:
                self._books[name].errored.pop(img, None)
        img.attempts, img.failure = 0, None

    def _queue_up(self, img: _Image, now: float) -> None:
        self._set(img, State.QUEUED, now)
        self._queue.append(img)

    def retry_failed(self) -> None:
        """Credentials changed: failed images are retried now, not at their backoff time."""
        now = self._clock()
        for at, img in self._due.items():
            if self._due_alive(at, img):
                img.retry_at = now
                self._due.push(now, img)
        self._wake.set()

    def resync(self) -> None:
        """Read the runtime's images again now (not at the next resync)."""
        self._need_list = True
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Reconcile until cancelled."""
        try:
            while True:
                self._wake.clear()
                self._collect_list()
                if self.sets:
                    await self._look()
                self._enqueue_due()
                self._feed()
                self._report()
                timeout = self._next_wake() - self._clock()
                if timeout > 0 and not self._wake.is_set():
                    await _wait(self._wake, timeout)
        finally:
            self.halt()

    async def drain(self) -> None:
        """Wait for cancelled prefetches to finish unwinding."""
        tasks = [*self._lanes, *([self._listing] if self._listing is not None else [])]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._listing = None

    def halt(self) -> None:
        """Stop every prefetch of ours (shutdown, or image sets turned off)."""
        now = self._clock()
        if self._listing is not None:
            self._listing.cancel()
        for task, img in list(self._lanes.items()):
            task.cancel()
            if img.state is State.PULLING and self._images.get(img.key) is img:
                self._set(img, State.UNKNOWN, now)
        for img in self._queue:
            if img.state is State.QUEUED and self._images.get(img.key) is img:
                self._set(img, State.UNKNOWN, now)
        self._queue.clear()
        self._need_list = True

    def _due_alive(self, at: float, img: _Image) -> bool:
        return img.state is State.FAILED and img.retry_at == at and self._images.get(img.key) is img

    def _next_wake(self) -> float:
        now = self._clock()
        t = now + 3600.0
        if self.sets and self._listing is None:
            t = min(t, self._next_list)
        due = self._due.next_at(self._due_alive)
        if due is not None:
            t = min(t, due)
        budget = self._budget.next_at()
        if budget is not None:
            t = min(t, budget)
        if self.disk_blocked and self._queue:
            t = min(t, self._disk_checked_at + self.disk_recheck_seconds)
        return t

    async def _look(self) -> None:
        """Learn which images the runtime has: ImageStatus for a few newly declared ones, else
        a full pass (one ListImages, and ImageFsInfo when the disk guard is on) in a task of its
        own. While that pass is on its way, images declared since it was asked for are looked
        up at once when they are few; when many, another pass follows it."""
        now = self._clock()
        if self._listing is None:
            if not (self._need_list or now >= self._next_list):
                return
            if (self._need_list and now < self._next_list and 0 < len(self._unknown) <= PROBE_MAX
                    and self._can_probe()):
                self._need_list = False
                await self._probe(list(self._unknown))
                return
            self._need_list = False
            self._list_started = now
            self._listing = asyncio.get_running_loop().create_task(self._list(now), name="image sets: ListImages")
            self._listing.add_done_callback(lambda _: self._wake.set())
        elif self._need_list and self._can_probe():
            since = self._declared_since(max(self._list_started, self._probe_failed_at))
            if 0 < len(since) <= PROBE_MAX:
                self._need_list = False
                if not await self._probe(since):
                    self._probe_failed_at = now  # not again while this list is on its way ...
                    self._need_list = True  # ... but once it has landed (it skips them)

    def _collect_list(self) -> None:
        """Forget the full pass once it has landed; a bug in it ends the loop, as it did inline."""
        if self._listing is not None and self._listing.done():
            done, self._listing = self._listing, None
            if not done.cancelled():
                done.result()

    def _declared_since(self, started: float) -> list[_Image]:
        """The images that became unknown after ``started``, newest last; at most PROBE_MAX + 1
        (more means a full pass). ``_unknown`` is in the order they became unknown."""
        newest: list[_Image] = []
        for img in reversed(self._unknown):
            if img.since < started or len(newest) > PROBE_MAX:
                break
            newest.append(img)
        newest.reverse()
        return newest

    def _can_probe(self) -> bool:
        return not (self.cfg.min_free_bytes > 0 and not self._mounts)  # the disk guard needs a full pass

    async def _list(self, started: float) -> None:
        """One full pass: what the runtime holds, against the last pass. An image whose state
        was decided after the list was asked for (pulled, probed, declared) keeps it."""
        wall = time.time()
        try:
            raw = await self.upstream.unary(LIST_IMAGES, b"",
                                            deadline=Deadline.after(self.cfg.runtime_timeout_seconds))
            if self.cfg.min_free_bytes > 0:
                await self._refresh_fs()
        except RpcError as e:
            self._list_failed(e)
            return
        self._runtime_ok()
        present, count = await asyncio.to_thread(self._present_names, raw)
        now = self._clock()
        appeared, went = present - self._present, self._present - present
        unseen: set[str] = set()  # appeared, but an image of that name was not decided by this list
        for name in appeared:
            for img in self._named(name):
                if img.state in (State.UNKNOWN, State.QUEUED, State.FAILED) and img.since <= started:
                    self._now_present(img, now)
                elif img.state is not State.PRESENT:
                    unseen.add(name)  # pulling, or decided after the list was asked for
        for name in went:
            for img in self._named(name):
                if img.state is State.PRESENT and img.since >= started:
                    present.add(name)  # pulled or probed while the list was on its way: newer than it
                elif img.state in (State.UNKNOWN, State.PRESENT):
                    self._queue_up(img, now)
        for img in list(self._unknown):
            if img.since > started:
                continue  # declared while the list was on its way: probed, or the next pass's
            if img.ref in present:
                self._now_present(img, now)
            else:
                self._queue_up(img, now)
        self._present = present - unseen  # the next pass sees those names appear again
        self._next_list = now + self.resync_seconds
        self.passes += 1
        self.metrics.image_set_reconciles.inc()
        missing = self._totals[State.QUEUED]
        self.last_pass = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)),
                          "seconds": round(now - started, 3), "runtime_images": count, "missing": missing}
        logs.log(_log, logging.DEBUG if not missing else logging.INFO, "image sets reconciled",
                 runtime_images=count, declared=len(self._images), missing=missing,
                 seconds=round(now - started, 3))
        self._report()  # the gauges say what status says from the moment the pass lands

    async def _probe(self, images: list[_Image]) -> bool:
        """ImageStatus for each of a few newly declared images. False: the runtime failed it
        (recorded as the runtime error; the images stay unknown)."""
        async def one(img: _Image) -> bool:
            req = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=img.spelled)).SerializeToString()
            raw = await self.upstream.unary(IMAGE_STATUS, req,
                                            deadline=Deadline.after(self.cfg.runtime_timeout_seconds))
            return bool(api_pb2.ImageStatusResponse.FromString(raw).image.id)

        try:
            found = await asyncio.gather(*(one(img) for img in images))
        except RpcError as e:
            self._list_failed(e, "ImageStatus")
            return False
        self._runtime_ok()
        now = self._clock()
        for img, here in zip(images, found):
            if img.state is not State.UNKNOWN or self._images.get(img.key) is not img:
                continue  # dropped or decided meanwhile
            if here:
                self._present.add(img.ref)
                self._now_present(img, now)
            else:
                self._queue_up(img, now)
        self.passes += 1
        return True

    def _list_failed(self, e: RpcError, method: str = "ListImages") -> None:
        self._list_failures += 1
        delay = self._backoff(self._list_failures)
        self._next_list = self._clock() + delay
        err = f"{method} failed: {e.code.name}: {e.details}"
        if err != self.runtime_error:
            logs.log(_log, logging.WARNING, "cannot read the runtime's images; will retry", error=err,
                     retry_in=round(delay, 3))
        self.runtime_error = err
        self._dirty.update(self.sets)

    def _runtime_ok(self) -> None:
        if self.runtime_error:
            logs.log(_log, logging.INFO, "runtime images readable again")
            self._dirty.update(self.sets)
        self.runtime_error = ""
        self._list_failures = 0

    def _present_names(self, raw: bytes) -> tuple[set[str], int]:
        """Every normalized tag and digest the runtime has (thread: no loop work). Names seen at
        the last pass keep their normal form (``_norm_cache``): when the runtime's names did not
        change, nothing is normalized again."""
        resp = api_pb2.ListImagesResponse.FromString(raw)
        spelled: set[str] = set()
        for image in resp.images:
            spelled.update(image.repo_tags)
            spelled.update(image.repo_digests)
        cache = self._norm_cache
        if cache.keys() != spelled:
            cache = self._norm_cache = {n: cache.get(n) or pull_name(n) for n in spelled}
        return set(cache.values()), len(resp.images)

    async def _refresh_fs(self) -> None:
        try:
            resp = api_pb2.ImageFsInfoResponse.FromString(
                await self.upstream.unary(IMAGE_FS_INFO, b"",
                                          deadline=Deadline.after(self.cfg.runtime_timeout_seconds)))
        except RpcError as e:
            self._mounts, self._fs_error = [], f"ImageFsInfo failed: {e.code.name}: {e.details}"
            return
        self._mounts = sorted({fs.fs_id.mountpoint for fs in resp.image_filesystems if fs.fs_id.mountpoint})
        self._fs_error = "" if self._mounts else "the runtime reported no image filesystem mountpoint"

    def _disk_short(self) -> str:
        """Why no pull may start now ('' when it may)."""
        need = self.cfg.min_free_bytes
        self._disk_checked_at = self._clock()
        if need <= 0:
            self.free_bytes = None
            return ""
        if self._fs_error:
            return f"cannot check free space ({self._fs_error}); image_sets.min_free_bytes is set"
        lowest: tuple[int, str] | None = None
        for m in self._mounts:
            try:
                st = self._statvfs(m)
            except OSError as e:
                return f"cannot check free space on {m}: {e.strerror}; image_sets.min_free_bytes is set"
            free = st.f_bavail * st.f_frsize
            if lowest is None or free < lowest[0]:
                lowest = (free, m)
        if lowest is None:
            return "cannot check free space: no image filesystem known yet"
        self.free_bytes = lowest[0]
        if lowest[0] < need:
            return (f"free space on {lowest[1]} is {human_bytes(lowest[0])}, below image_sets.min_free_bytes "
                    f"{human_bytes(need)}; not pulling until space is freed")
        return ""

    def _backoff(self, attempts: int) -> float:
        return min(self.cfg.retry_initial_seconds * (2.0 ** max(attempts - 1, 0)), self.cfg.retry_max_seconds)

    def _enqueue_due(self) -> None:
        """Failed images whose backoff ran out take a token of their registry's retry budget,
        or wait in its FIFO; those that earned a token since are queued."""
        now = self._clock()
        for img in self._due.pop_due(now, self._due_alive):
            if self._budget.admit(_host(img), img, now):
                self._queue_up(img, now)
        for img in self._budget.release(now):
            if img.state is State.FAILED and self._images.get(img.key) is img:
                self._queue_up(img, now)

    def _set_disk_blocked(self, reason: str) -> None:
        if reason != self.disk_blocked:
            self._dirty.update(self.sets)
        self.disk_blocked = reason

    def _feed(self) -> None:
        """Start pulls while a lane is free and the disk guard allows."""
        while self._queue and len(self._lanes) < self.cfg.max_parallel:
            img = self._queue[0]
            if self._images.get(img.key) is not img or img.state is not State.QUEUED:
                self._queue.popleft()
                continue
            reason = self._disk_short()
            if reason:
                if reason != self.disk_blocked and not self.disk_blocked:
                    logs.log(_log, logging.WARNING, "image set prefetch paused", reason=reason,
                             waiting=self._totals[State.QUEUED])
                self._set_disk_blocked(reason)
                return
            if self.disk_blocked:
                logs.log(_log, logging.INFO, "image set prefetch resumed", free_bytes=self.free_bytes)
                self._set_disk_blocked("")
            self._queue.popleft()
            self._set(img, State.PULLING, self._clock())
            task = asyncio.get_running_loop().create_task(self._lane(img), name=f"prefetch {img.ref}")
            img.task = task
            self._lanes[task] = img
            task.add_done_callback(self._lane_done)
        if not self._queue and self.disk_blocked:
            self._set_disk_blocked("")

    def _lane_done(self, task: asyncio.Task[None]) -> None:
        self._lanes.pop(task, None)
        self._wake.set()

    async def _lane(self, img: _Image) -> None:
        await self._pull(img)
        if self.cfg.cooldown_seconds > 0:
            await asyncio.sleep(self.cfg.cooldown_seconds)

    def _handler(self, img: _Image) -> tuple[str, str]:
        """(handler, where it came from) for this pull: the set's, else a rule's, else none."""
        if img.handler:
            return img.handler, "image set"
        if self._handler_for is not None:
            decision = self._handler_for(img.spelled)
            if decision is not None:
                return decision
        return "", "none"

    async def _credentials(self, img: _Image) -> list[Credential | None]:
        """What to try, in order: matching config.json and credential-provider entries (one
        keyring, most specific key first, as kubelet merges its providers), else anonymous."""
        try:
            entries = self.credentials.entries()
            if self.set_credentials is not None:
                entries = self.set_credentials(frozenset(img.sets)) + entries
            if self.plugins is not None:
                entries += await self.plugins.entries(img.spelled)
            found: list[Credential | None] = list(Keyring(entries).lookup(img.spelled))
        except Exception as e:  # never let a credential file stop prefetch; never log its content
            logs.log(_log, logging.WARNING, "registry credentials unavailable; pulling anonymously",
                     error=type(e).__name__)
            found = []
        return found or [None]

    async def _pull(self, img: _Image) -> None:
        handler, handler_source = self._handler(img)
        attempts = await self._credentials(img)
        self.pulls_started += 1
        self.metrics.pull_requests_total.labels("background").inc()
        t0 = self._clock()
        error: RpcError | None = None
        for i, cred in enumerate(attempts):
            req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=img.spelled, runtime_handler=handler))
            if cred is not None:
                req.auth.CopyFrom(cred.auth_config())
            if handler:  # containerd honours ImageSpec.runtime_handler only with a sandbox_config
                req.sandbox_config.CopyFrom(PREFETCH_POD)
            request = req.SerializeToString()

            async def run(request: bytes = request) -> bytes:
                return await self.upstream.unary(PULL_IMAGE, request)

            key = pull_key(req, handler)
            try:
                outcome = await self.scheduler.pull(key, run, priority=Priority.BACKGROUND,
                                                    deadline=Deadline.after(self.cfg.pull_timeout_seconds))
            except RpcError as e:
                error = e
                if e.code is grpc.StatusCode.DEADLINE_EXCEEDED and not e.from_upstream:  # ours: name the key
                    error = RpcError(e.code, f"{e.details} (image_sets.pull_timeout_seconds: "
                                             f"{self.cfg.pull_timeout_seconds:g} s)")
                    break
                if e.code is grpc.StatusCode.CANCELLED or i == len(attempts) - 1:
                    break
                logs.log(_log, logging.INFO, "image set pull failed with these credentials; trying the next",
                         image=img.ref, credentials=cred.source if cred else "none", code=e.code.name)
                continue
            error = None
            break
        img.task = None
        if error is not None:
            if error.code is not grpc.StatusCode.CANCELLED:
                self._budget.failed(_host(img), self._clock())
            if self._images.get(img.key) is not img or img.state is not State.PULLING:
                return  # dropped (or halted) meanwhile
            now = self._clock()
            delay = self._failed(img, PullFailure.of(error), now)
            logs.log(_log, logging.WARNING, "image set pull failed; will retry", image=img.ref, handler=handler,
                     sets=",".join(sorted(img.sets)), code=error.code.name, error=error.details, attempts=img.attempts,
                     retry_in=round(delay, 3))
            return
        self._budget.succeeded(_host(img), self._clock())
        self._present.add(img.ref)
        if self._images.get(img.key) is img:
            self._now_present(img, self._clock())
        logs.log(_log, logging.DEBUG, "image set pull done", image=img.ref, handler=handler,
                 handler_source=handler_source, credentials=cred.source if cred else "none",
                 joined=outcome.joined, seconds=round(self._clock() - t0, 3))

    # ------------------------------------------------------------------ reporting

    def _report(self) -> None:
        """Gauges and progress lines of the sets whose counts changed since the last report."""
        gauge = self.metrics.image_set_images
        for name in self._gone:
            for state in COUNTED:
                gauge.remove(name, state)
        self._gone.clear()
        for name in self._dirty:
            s = self.sets.get(name)
            if s is None:
                continue
            book = self._books[name]
            c = Counts.of(len(s.refs), book.counts).as_dict()
            for state in COUNTED:
                gauge.labels(name, state).set(c[state])
            if book.counts[State.UNKNOWN]:
                continue  # not listed yet: no progress to speak of
            pct = 100 * c["present"] // c["declared"] if c["declared"] else 100
            step = max([p for p in PROGRESS_STEPS if p <= pct], default=0)
            gen, logged = self._progress.get(name, ("", 0))
            if gen != s.generation:
                logged = 0
            if step > logged:
                logs.log(_log, logging.INFO, "image set progress", set=name, generation=s.generation,
                         percent=step, present=c["present"], declared=c["declared"], failed=c["failed"])
            self._progress[name] = (s.generation, step)
        self._dirty.clear()

    def _pinned(self, s: ImageSet, book: _Book, pins: PinSet | None) -> int | None:
        """Images of a pinning set that the pins in force match. When the pin ledger says those
        pins hold every name of this version (``pinned_fully``), that is all of them (no count).
        Otherwise they are counted once per pins object and set generation, not at every snapshot."""
        if not s.pin:
            return None
        if pins is None:
            return len(s.refs)
        if self._pinned_fully is not None and self._pinned_fully(pins.declared, s.name, s.generation):
            return len(s.refs)
        cached = book.pinned
        if cached is not None and cached[0] is pins and cached[1] == s.generation:
            return cached[2]
        n = sum(1 for r in s.refs if pins.match([r]) is not None)
        book.pinned = (pins, s.generation, n)
        return n

    def snapshot(self) -> Snapshot:
        """What every set stands at now: costs the number of sets (and of running pulls)."""
        pins = self._pins() if self._pins is not None else None
        pulling: dict[str, list[str]] = {}
        for img in self._lanes.values():
            for name in img.sets:
                pulling.setdefault(name, []).append(img.spelled)
        out: dict[str, SetSnapshot] = {}
        for name in sorted(self.sets):
            s, book = self.sets[name], self._books[name]
            c = Counts.of(len(s.refs), book.counts)
            blocked = ""
            if c.queued and self.disk_blocked:
                blocked = self.disk_blocked
            elif c.declared != c.present and self.runtime_error:
                blocked = self.runtime_error
            last = next(reversed(book.errored), None)
            out[name] = SetSnapshot(
                name=name, kind=s.kind, source=s.source, generation=s.generation, pin=s.pin, counts=c,
                failed_reasons=dict(book.reasons), last_error=f"{last.ref}: {last.error}" if last is not None else "",
                blocked=blocked, pinned=self._pinned(s, book, pins), pulling=tuple(pulling.get(name, ())),
                ignored=s.ignored, runtime_handlers=tuple(sorted({h for h in s.handlers if h})))
        totals = Counts.of(len(self._images), self._totals)
        return Snapshot(sets=out, totals=totals, refused={n: why for n, (_, why) in sorted(self._refused.items())},
                        disk_blocked=self.disk_blocked, runtime_error=self.runtime_error, passes=self.passes)

    def status(self) -> dict[str, Any]:
        snap = self.snapshot()
        now = self._clock()
        sets: dict[str, Any] = {}
        for name, v in snap.sets.items():
            row: dict[str, Any] = {"kind": v.kind, "file": v.source, "generation": v.generation, "pin": v.pin,
                                   **v.counts.as_dict(), "last_error": v.last_error or v.blocked}
            if v.pinned is not None:
                row["pinned"] = v.pinned
            if v.failed_reasons:
                row["failed_reasons"] = dict(v.failed_reasons)
            if v.ignored:
                row["ignored_fields"] = list(v.ignored)
            if v.runtime_handlers:
                row["runtime_handlers"] = list(v.runtime_handlers)
            if name in snap.refused:
                row["refused"] = snap.refused[name]
            sets[name] = row
        waiting = [img for img in self._budget.items()  # due, no token yet
                   if img.state is State.FAILED and self._images.get(img.key) is img]
        failed = waiting[:20] + sorted((img for at, img in self._due.items() if self._due_alive(at, img)),
                                       key=lambda i: i.retry_at)[:20 - min(20, len(waiting))]
        t = snap.totals
        return {
            "sets": sets,
            "refused": dict(snap.refused),
            "max_images": self.cfg.max_images,
            "declared_entries": self._declared,
            "images": t.by_state(),
            "failed": [{"image": i.ref, **({"runtime_handler": i.handler} if i.handler else {}),
                        "sets": sorted(i.sets), "attempts": i.attempts, "error": i.error, "reason": i.reason,
                        "retry_in_seconds": round(max(0.0, i.retry_at - now), 3)} for i in failed],
            "retry_budget": {"per_second": self.cfg.retry_per_second, "waiting": self._budget.waiting(),
                             "slowed": self._budget.slowed()},
            "disk": {"min_free_bytes": self.cfg.min_free_bytes, "free_bytes": self.free_bytes,
                     "mountpoints": list(self._mounts), "blocked": self.disk_blocked},
            "runtime_error": self.runtime_error,
            "last_pass": dict(self.last_pass),
            "background_pulls_started": self.pulls_started,
            "credentials": {"docker_config": self.credentials.status(),
                            **({"plugins": self.plugins.status()} if self.plugins is not None else {})},
        }
