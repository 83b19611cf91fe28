"""Keeping declared image sets present: diff against the runtime, pull only the difference.

One pass reads the runtime's images once (ListImages), marks every declared image
present or missing, and queues the missing ones. Pulls go through the node-wide
scheduler at background priority, at most ``image_sets.max_parallel`` of ours at a
time; each lane pauses ``cooldown_seconds`` after a pull. Before each pull starts, the
free space of the runtime's image filesystem (ImageFsInfo mountpoint + statvfs) is
checked against ``min_free_bytes``; when short, nothing new starts and status says why.

A failed image is retried after ``retry_initial_seconds``, doubling up to
``retry_max_seconds``; it never holds the others back. An image dropped from every
set is forgotten: its queued or running prefetch is cancelled (the scheduler drops
the flight unless a CRI client joined it, whose pull goes on), its pin is released,
and the image itself is left to kubelet's garbage collection.

Each pull is for the image's runtime handler: the one its set declares, else the
first ``runtime_handlers.rules`` entry that matches the image without a pod (no
``namespaces``/``pod_labels`` matchers). With a handler the request carries a minimal
``sandbox_config`` (containerd reads the handler only then). Credentials come from the
node's docker config.json files (``image_sets.docker_config``, kubelet's keyring rules);
several matching entries are tried in order, most specific first, as kubelet does.
The scheduler's join rule applies: a prefetch joins a CRI client's running pull of the
same image and handler whatever its credentials.

The reconciler's own ListImages and ImageFsInfo calls have a deadline
(``image_sets.runtime_timeout_seconds``): a runtime that hangs is a failed list, retried
with backoff, never a stuck loop.

Nothing here is on the path of a CRI call: kubelet never waits for a reconcile.

Why one module of ~600 lines: every part here (the diff, the lanes, the disk guard, the
retry clock, the per-set counts) reads and writes the same per-image state (``_Image``)
under one rule: only ``_feed`` starts pulls. Split across modules, that state would have
to be shared by reference and the rule would no longer be visible in one place.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from ..config import ImageSetsConfig
from ..credentials import Credential, DockerConfigFiles, Keyring
from ..credentials.plugins import PluginProviders, ProviderConfigError
from ..cri.methods import IMAGE_FS_INFO, LIST_IMAGES, PULL_IMAGE
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..images.pins import PinSet
from ..observability import logs
from ..observability.metrics import Metrics
from ..proto.runtime.v1 import api_pb2
from ..pulls.failure import PullFailure
from ..pulls.key import pull_key
from ..pulls.progress import human_bytes
from ..pulls.scheduler import PullScheduler
from ..pulls.slots import Priority
from ..reference import InvalidReference, normalize
from .loader import ImageSet

_log = logs.get("imagesets")

RESYNC_SECONDS = 60.0  # re-read the runtime's images this often (GC, crictl rmi)
DISK_RECHECK_SECONDS = 30.0  # while short of space
PROGRESS_STEPS = (25, 50, 75, 100)
STATES = ("declared", "present", "pulling", "queued", "failed")

PinSink = Callable[[list[tuple[str, str]]], None]
HandlerFor = Callable[[str], "tuple[str, str] | None"]  # image -> (handler, where the rule is), or None
SetCredentials = Callable[[frozenset[str]], "list[tuple[str, Credential]]"]  # set names -> their pull secrets' entries
ImageKey = tuple[str, str]  # (canonical ref, declared runtime handler)
PREFETCH_POD = api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(
    name="cri-shim-prefetch", uid="cri-shim-prefetch", namespace="cri-shim"))


class State(enum.Enum):
    UNKNOWN = "unknown"  # declared since the last ListImages
    PRESENT = "present"
    QUEUED = "queued"  # missing, waiting for a lane (or for disk space)
    PULLING = "pulling"  # handed to the scheduler
    FAILED = "failed"  # waiting for its retry


@dataclass(eq=False)
class _Image:
    ref: str  # canonical
    spelled: str  # as first declared: what is pulled (so a kubelet pull of the same string collapses)
    sets: set[str]
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


def _keys(s: ImageSet) -> list[ImageKey]:
    return list(zip(s.refs, s.handlers or ("",) * len(s.refs)))


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
                 on_pins: PinSink, pins: Callable[[], PinSet] | None = None,
                 handler_for: HandlerFor | None = None, credentials: DockerConfigFiles | None = None,
                 set_credentials: SetCredentials | None = None,
                 statvfs: Callable[[str], Any] = os.statvfs, clock: Callable[[], float] = time.monotonic,
                 resync_seconds: float = RESYNC_SECONDS, disk_recheck_seconds: float = DISK_RECHECK_SECONDS) -> None:
        self.cfg = cfg
        self.upstream = upstream
        self.scheduler = scheduler
        self.metrics = metrics
        self._on_pins = on_pins
        self._pins = pins
        self._handler_for = handler_for
        self.credentials = credentials if credentials is not None else DockerConfigFiles(cfg.docker_config)
        self.set_credentials = set_credentials  # a set's own pull secrets (cluster sets), before the node's
        self.plugins: PluginProviders | None = None
        self._load_plugins(cfg)
        self._statvfs = statvfs
        self._clock = clock
        self.resync_seconds = resync_seconds
        self.disk_recheck_seconds = disk_recheck_seconds

        self.sets: dict[str, ImageSet] = {}
        self.images: dict[ImageKey, _Image] = {}
        self._queue: deque[_Image] = deque()
        self._lanes: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._need_list = True
        self._list_failures = 0
        self._next_list = 0.0
        self._declared_pins: list[tuple[str, str]] | None = None
        self._progress: dict[str, tuple[str, int]] = {}  # set -> (generation, last step logged)
        self._gauge_sets: set[str] = set()
        self._norm_cache: dict[str, str] = {}

        self.runtime_error = ""
        self.disk_blocked = ""
        self._disk_checked_at = 0.0
        self._mounts: list[str] = []
        self._fs_error = ""
        self.free_bytes: int | None = None
        self.last_pass: dict[str, Any] = {}
        self.pulls_started = 0

    # ------------------------------------------------------------------ inputs

    def configure(self, cfg: ImageSetsConfig) -> None:
        self.cfg = cfg
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

    def set_sets(self, sets: dict[str, ImageSet]) -> None:
        """The declared sets changed: re-diff (one ListImages), cancel what is no longer declared."""
        declared: dict[ImageKey, tuple[str, set[str]]] = {}
        for s in sets.values():
            for key, spelled in zip(_keys(s), s.spelled):
                entry = declared.get(key)
                if entry is None:
                    declared[key] = (spelled, {s.name})
                else:
                    entry[1].add(s.name)
        now = self._clock()
        for key in [k for k in self.images if k not in declared]:
            img = self.images.pop(key)
            if img.task is not None:
                img.task.cancel()
                logs.log(_log, logging.INFO, "image dropped from its sets; prefetch cancelled", image=key[0],
                         handler=key[1])
        for key, (spelled, names) in declared.items():
            known = self.images.get(key)
            if known is None:
                self.images[key] = _Image(key[0], spelled, names, handler=key[1], since=now)
            else:
                known.sets = names
        self._queue = deque(i for i in self._queue if self.images.get(i.key) is i)
        for name, s in sets.items():
            old = self.sets.get(name)
            if old is None or old.generation != s.generation:
                logs.log(_log, logging.INFO, "image set loaded", set=name, kind=s.kind, generation=s.generation,
                         images=len(s.refs), pin=s.pin, file=s.source)
                if s.ignored:
                    logs.log(_log, logging.INFO, "image set fields ignored on a single node", set=name,
                             fields=",".join(s.ignored))
        for name in self.sets.keys() - sets.keys():
            logs.log(_log, logging.INFO, "image set removed; its images stay until kubelet GC removes them",
                     set=name)
        self.sets = dict(sets)
        self._update_pins()
        self._need_list = True
        self._next_list = 0.0
        self._wake.set()

    def retry_failed(self) -> None:
        """Credentials changed: failed images are retried now, not at their backoff time."""
        now = self._clock()
        for img in self.images.values():
            if img.state is State.FAILED:
                img.retry_at = now
        self._wake.set()

    def _update_pins(self) -> None:
        pins = [(ref, s.name) for s in self.sets.values() if s.pin for ref in s.refs]
        if pins != self._declared_pins:
            self._declared_pins = pins
            self._on_pins(pins)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Reconcile until cancelled."""
        try:
            while True:
                self._wake.clear()
                now = self._clock()
                if self.sets and (self._need_list or now >= self._next_list):
                    await self._list()
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
        if self._lanes:
            await asyncio.gather(*list(self._lanes), return_exceptions=True)

    def halt(self) -> None:
        """Stop every prefetch of ours (shutdown, or image sets turned off)."""
        for task in list(self._lanes):
            task.cancel()
        for img in self.images.values():
            if img.state in (State.PULLING, State.QUEUED):
                img.state = State.UNKNOWN
        self._queue.clear()

    def _next_wake(self) -> float:
        now = self._clock()
        t = now + 3600.0
        if self.sets:
            t = min(t, self._next_list)
        t = min([t] + [i.retry_at for i in self.images.values() if i.state is State.FAILED])
        if self.disk_blocked and self._queue:
            t = min(t, self._disk_checked_at + self.disk_recheck_seconds)
        return t

    async def _list(self) -> None:
        """One ListImages (and ImageFsInfo when the disk guard is on); mark present/missing."""
        started = self._clock()
        wall = time.time()
        self._need_list = False
        try:
            raw = await self.upstream.unary(LIST_IMAGES, b"", timeout=self.cfg.runtime_timeout_seconds)
            if self.cfg.min_free_bytes > 0:
                await self._refresh_fs()
        except RpcError as e:
            self._list_failures += 1
            delay = self._backoff(self._list_failures)
            self._next_list = self._clock() + delay
            err = f"ListImages failed: {e.code.name}: {e.details}"
            if err != self.runtime_error:
                logs.log(_log, logging.WARNING, "cannot read the runtime's images; will retry", error=err,
                         retry_in=round(delay, 3))
            self.runtime_error = err
            return
        if self.runtime_error:
            logs.log(_log, logging.INFO, "runtime images readable again")
        self.runtime_error = ""
        self._list_failures = 0
        present, count = await asyncio.to_thread(self._present_names, raw)
        now = self._clock()
        missing = 0
        for img in self.images.values():
            if img.ref in present:
                if img.state in (State.UNKNOWN, State.QUEUED, State.FAILED):
                    self._set(img, State.PRESENT, now)
                    img.attempts, img.failure = 0, None
            elif img.state is State.PRESENT and img.since >= started:
                pass  # pulled while the list was on its way: newer than the list
            elif img.state in (State.UNKNOWN, State.PRESENT):
                self._set(img, State.QUEUED, now)
                self._queue.append(img)
                missing += 1
            elif img.state is State.QUEUED:
                missing += 1
        self._queue = deque(sorted(self._queue, key=lambda i: i.since))
        self._next_list = now + self.resync_seconds
        self.metrics.image_set_reconciles.inc()
        self.last_pass = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)),
                          "seconds": round(now - started, 3), "runtime_images": count, "missing": missing}
        logs.log(_log, logging.DEBUG if not missing else logging.INFO, "image sets reconciled",
                 runtime_images=count, declared=len(self.images), missing=missing,
                 seconds=round(now - started, 3))

    def _present_names(self, raw: bytes) -> tuple[set[str], int]:
        """Every normalized tag and digest the runtime has (thread: no loop work)."""
        resp = api_pb2.ListImagesResponse.FromString(raw)
        cache, new_cache = self._norm_cache, {}
        names: set[str] = set()
        for image in resp.images:
            for n in (*image.repo_tags, *image.repo_digests):
                c = cache.get(n)
                if c is None:
                    try:
                        c = normalize(n)
                    except InvalidReference:
                        c = n
                new_cache[n] = c
                names.add(c)
        self._norm_cache = new_cache
        return names, len(resp.images)

    async def _refresh_fs(self) -> None:
        try:
            resp = api_pb2.ImageFsInfoResponse.FromString(
                await self.upstream.unary(IMAGE_FS_INFO, b"", timeout=self.cfg.runtime_timeout_seconds))
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

    def _set(self, img: _Image, state: State, now: float) -> None:
        img.state, img.since = state, now

    def _enqueue_due(self) -> None:
        now = self._clock()
        due = [i for i in self.images.values() if i.state is State.FAILED and i.retry_at <= now]
        for img in sorted(due, key=lambda i: i.retry_at):
            self._set(img, State.QUEUED, now)
            self._queue.append(img)

    def _feed(self) -> None:
        """Start pulls while a lane is free and the disk guard allows."""
        while self._queue and len(self._lanes) < self.cfg.max_parallel:
            reason = self._disk_short()
            if reason:
                if reason != self.disk_blocked and not self.disk_blocked:
                    logs.log(_log, logging.WARNING, "image set prefetch paused", reason=reason,
                             waiting=len(self._queue))
                self.disk_blocked = reason
                return
            if self.disk_blocked:
                logs.log(_log, logging.INFO, "image set prefetch resumed", free_bytes=self.free_bytes)
                self.disk_blocked = ""
            img = self._queue.popleft()
            if self.images.get(img.key) is not img or img.state is not State.QUEUED:
                continue
            self._set(img, State.PULLING, self._clock())
            task = asyncio.get_running_loop().create_task(self._lane(img), name=f"prefetch {img.ref}")
            img.task = task
            self._lanes.add(task)
            task.add_done_callback(self._lane_done)
        if not self._queue and self.disk_blocked:
            self.disk_blocked = ""

    def _lane_done(self, task: asyncio.Task[None]) -> None:
        self._lanes.discard(task)
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
                outcome = await self.scheduler.pull(key, run, priority=Priority.BACKGROUND)
            except RpcError as e:
                error = e
                if e.code is grpc.StatusCode.CANCELLED or i == len(attempts) - 1:
                    break
                logs.log(_log, logging.INFO, "image set pull failed with these credentials; trying the next",
                         image=img.ref, credentials=cred.source if cred else "none", code=e.code.name)
                continue
            error = None
            break
        img.task = None
        if error is not None:
            if self.images.get(img.key) is not img:
                return  # dropped meanwhile
            img.attempts += 1
            img.failure = PullFailure.of(error)
            delay = self._backoff(img.attempts)
            img.retry_at = self._clock() + delay
            self._set(img, State.FAILED, self._clock())
            logs.log(_log, logging.WARNING, "image set pull failed; will retry", image=img.ref, handler=handler,
                     sets=",".join(sorted(img.sets)), code=error.code.name, error=error.details, attempts=img.attempts,
                     retry_in=round(delay, 3))
            return
        img.attempts, img.failure = 0, None
        self._set(img, State.PRESENT, self._clock())
        logs.log(_log, logging.DEBUG, "image set pull done", image=img.ref, handler=handler,
                 handler_source=handler_source, credentials=cred.source if cred else "none",
                 joined=outcome.joined, seconds=round(self._clock() - t0, 3))

    # ------------------------------------------------------------------ reporting

    def _counts(self, s: ImageSet) -> dict[str, int]:
        c = {"declared": len(s.refs), "present": 0, "pulling": 0, "queued": 0, "failed": 0}
        images = self.images
        for key in _keys(s):
            img = images.get(key)
            if img is None:
                continue
            st = img.state
            if st is State.PRESENT:
                c["present"] += 1
            elif st is State.PULLING:
                c["pulling"] += 1
            elif st is State.QUEUED:
                c["queued"] += 1
            elif st is State.FAILED:
                c["failed"] += 1
        return c

    def _report(self) -> None:
        gauge = self.metrics.image_set_images
        for name in self._gauge_sets - self.sets.keys():
            for state in STATES:
                gauge.remove(name, state)
            self._progress.pop(name, None)
        self._gauge_sets = set(self.sets)
        for name, s in self.sets.items():
            c = self._counts(s)
            for state in STATES:
                gauge.labels(name, state).set(c[state])
            if any(self.images.get(k) is not None and self.images[k].state is State.UNKNOWN for k in _keys(s)):
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

    def _last_error(self, s: ImageSet) -> str:
        worst: _Image | None = None
        for key in _keys(s):
            img = self.images.get(key)
            if img is not None and img.error and (worst is None or img.since > worst.since):
                worst = img
        if worst is not None:
            return f"{worst.ref}: {worst.error}"
        return ""

    def status(self) -> dict[str, Any]:
        pins = self._pins() if self._pins is not None else None
        now = self._clock()
        sets: dict[str, Any] = {}
        for name, s in sorted(self.sets.items()):
            c = self._counts(s)
            blocked = ""
            if c["queued"] and self.disk_blocked:
                blocked = self.disk_blocked
            elif c["declared"] != c["present"] and self.runtime_error:
                blocked = self.runtime_error
            row: dict[str, Any] = {"kind": s.kind, "file": s.source, "generation": s.generation, "pin": s.pin,
                                   **c, "last_error": self._last_error(s) or blocked}
            if s.pin:
                row["pinned"] = sum(1 for r in s.refs if pins is not None and pins.match([r]) is not None)
            if c["failed"]:
                row["failed_reasons"] = dict(Counter(img.reason for k in _keys(s) if (img := self.images.get(k))
                                                     is not None and img.state is State.FAILED))
            if s.ignored:
                row["ignored_fields"] = list(s.ignored)
            if any(s.handlers):
                row["runtime_handlers"] = sorted({h for h in s.handlers if h})
            sets[name] = row
        failed = sorted((i for i in self.images.values() if i.state is State.FAILED), key=lambda i: i.retry_at)
        return {
            "sets": sets,
            "images": {st: sum(1 for i in self.images.values() if i.state.value == st)
                       for st in ("present", "pulling", "queued", "failed", "unknown")},
            "failed": [{"image": i.ref, **({"runtime_handler": i.handler} if i.handler else {}),
                        "sets": sorted(i.sets), "attempts": i.attempts, "error": i.error, "reason": i.reason,
                        "retry_in_seconds": round(max(0.0, i.retry_at - now), 3)} for i in failed[:20]],
            "disk": {"min_free_bytes": self.cfg.min_free_bytes, "free_bytes": self.free_bytes,
                     "mountpoints": list(self._mounts), "blocked": self.disk_blocked},
            "runtime_error": self.runtime_error,
            "last_pass": dict(self.last_pass),
            "background_pulls_started": self.pulls_started,
            "credentials": {"docker_config": self.credentials.status(),
                            **({"plugins": self.plugins.status()} if self.plugins is not None else {})},
        }
