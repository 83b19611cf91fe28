"""One poller for the progress of every upstream pull, and the stall and no-progress guards.

While at least one pull runs upstream, every ``pulls.progress_interval_seconds`` the poller
asks the runtime's content API (containerd's; none on CRI-O) what is being downloaded, the
same few calls whatever the number of pulls (``tick``). From that each pull gets bytes and
layers done and total, a rate and a phase (resolving, downloading, unpacking, or unknown:
nothing is guessed). The stall guard (``pulls.stall_timeout_seconds``) fails a pull whose
download moves too slowly, the no-progress guard (``pulls.no_progress_timeout_seconds``) one
that made no progress at all, both with UNAVAILABLE for every waiter; a pull whose progress
cannot be judged gives its slot back instead (lease.py, asking ``unjudged``). docs/pulls.md
("Pull progress and the stall guard") says which calls, which bounds, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from .. import reference
from ..config import PullsConfig
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..observability import logs
from .content import ContentClient, NoContentApi, digest_filter, repo_filters
from .events import ProgressEvents
from .progress import (
    RATE_WINDOW_SECONDS,
    FlightProgress,
    Manifest,
    StoredManifest,
    Unresolved,
    human_bytes,
    ingest_digest,
    no_progress_message,
    parse_manifest,
    resolve,
    stall_message,
    stall_window,
)
from .scheduler import Flight, PullEvents, PullScheduler

_log = logs.get("progress")

MAX_READS_PER_TICK = 2
MAX_ABORTS_PER_TICK = 4
CLEANUP_SECONDS = 30.0  # how long to keep trying to abort a stalled pull's ingests
NO_API_RECHECK_SECONDS = 300.0
MANIFEST_CACHE = 256
STALL_CODE = grpc.StatusCode.UNAVAILABLE  # transient: the registry or the link; kubelet retries with back-off


@dataclass
class Tracked:
    flight: Flight
    progress: FlightProgress
    started_wall: float
    host: str = ""
    domain: str = ""  # the registry as the reference names it (with its port)
    repo: str = ""
    ref: str = ""
    digest: str | None = None
    stalled: bool = False  # ended by the stall guard or the no-progress guard
    last_progress: float = 0.0  # monotonic: when the no-progress guard last saw it move
    progress_token: object = None  # what it saw then
    ended_wall: float | None = None
    resolved_tick: int = -1  # the poll that found the manifest: its blobs are first looked up on the next one


@dataclass
class _Cleanup:
    blobs: set[str]
    until: float


@dataclass
class ProgressPoller(PullEvents):
    upstream: Upstream
    scheduler: PullScheduler
    events: ProgressEvents  # the metrics
    cfg: PullsConfig
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    client: ContentClient = field(init=False)
    running: dict[int, Tracked] = field(default_factory=dict)  # flight seq -> tracked
    recent: list[Tracked] = field(default_factory=list)  # finished, kept while they overlap running ones
    manifests: OrderedDict[str, Manifest | None] = field(default_factory=OrderedDict)
    counted: dict[str, int] = field(default_factory=dict)  # blob -> bytes already in cri_shim_pull_bytes_total
    cleanups: list[_Cleanup] = field(default_factory=list)
    no_api: str | None = None
    no_api_at: float = 0.0
    ticks: int = 0
    node_ingests: frozenset[tuple[str, int]] = frozenset()  # every ingest (blob, offset) at the last poll
    node_moved: float = 0.0  # monotonic: when that last changed
    autostart: bool = True  # tests drive tick() themselves
    _task: asyncio.Task[None] | None = None
    _closed: bool = False

    def __post_init__(self) -> None:
        self.client = ContentClient(self.upstream, self.events.content_called)
        self.scheduler.subscribe(self)

    # ------------------------------------------------------------------ configuration

    def configure(self, cfg: PullsConfig) -> None:
        self.cfg = cfg
        for t in self.running.values():
            t.progress.keep_seconds = self._keep_seconds()
        if cfg.progress_interval_seconds <= 0:
            for t in self.running.values():
                t.progress.unknown = "pull progress is off (pulls.progress_interval_seconds: 0)"
        elif self.running:
            for t in self.running.values():
                if t.progress.unknown and t.progress.unknown.startswith("pull progress is off"):
                    t.progress.unknown = None
            self._ensure_task()

    def _keep_seconds(self) -> float:
        window = stall_window(self.cfg.stall_timeout_seconds, self.cfg.stall_min_bytes_per_second)
        return max(RATE_WINDOW_SECONDS, window) + 5.0

    @property
    def enabled(self) -> bool:
        return self.cfg.progress_interval_seconds > 0

    # ------------------------------------------------------------------ scheduler hooks

    def flight_started(self, flight: Flight, waited: float) -> None:
        try:
            self._started(flight)
        except Exception:  # never in the scheduler's way
            _log.exception("pull progress: cannot follow a pull")

    def flight_finished(self, flight: Flight, seconds: float) -> None:
        try:
            self._finished(flight)
        except Exception:  # the scheduler must get its slot back whatever happens here
            _log.exception("pull progress: error at the end of a pull")

    def _started(self, flight: Flight) -> None:
        now = self.clock()
        t = Tracked(flight, FlightProgress(flight.key.image, now), self.wall(), last_progress=now)
        t.progress.keep_seconds = self._keep_seconds()
        try:
            ref = reference.parse(flight.key.image)
            t.host, t.domain, t.repo, t.digest = _source_host(ref.domain), ref.domain, ref.path, ref.digest
            t.ref = str(ref.with_default_tag())
        except reference.InvalidReference:
            t.progress.unknown = "not an image reference the runtime's records can be matched to"
        if not self.enabled:
            t.progress.unknown = "pull progress is off (pulls.progress_interval_seconds: 0)"
        elif self.no_api is not None:
            t.progress.unknown = self.no_api
        self.running[flight.seq] = t
        self._ensure_task()

    def _finished(self, flight: Flight) -> None:
        t = self.running.pop(flight.seq, None)
        if t is None:
            return
        t.ended_wall = self.wall()
        p = t.progress
        now = self.clock()
        if flight.result == "success" and p.known:  # all of it is in, whether or not a poll saw the end
            for step in p.complete():
                self._step(t, step, now)
            self._count_bytes(p, only_seen=True)
        seconds = now - p.started
        if p.known and p.downloaded >= (1 << 20) and seconds > 0:
            self.events.pull_throughput(p.downloaded / seconds)
        if t.digest is None and t.repo:
            self.recent.append(t)
        if t.stalled and p.manifest is not None:
            keep = {b.digest for r in self.running.values() if r.progress.manifest for b in r.progress.manifest.blobs}
            blobs = {b.digest for b in p.manifest.blobs} - keep
            if blobs:
                self.cleanups.append(_Cleanup(blobs, self.clock() + CLEANUP_SECONDS))
        self._publish_gauges()

    def unjudged(self, flight: Flight) -> str | None:
        """Why the no-progress guard cannot judge ``flight`` now (None: it does; lease.py)."""
        if not self.enabled:
            return "pull progress is off (pulls.progress_interval_seconds: 0)"
        t = self.running.get(flight.seq)
        if t is None:
            return "its progress is not followed"
        return None if t.stalled else t.progress.unknown

    def view(self, flight_id: int) -> dict[str, Any] | None:
        t = self.running.get(flight_id)
        return None if t is None else t.progress.view(self.clock())

    # ------------------------------------------------------------------ the loop

    def _ensure_task(self) -> None:
        if not self.autostart or self._closed or not self.enabled or (self._task is not None and not self._task.done()):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to poll for
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="pull-progress")

    async def _loop(self) -> None:
        # The first poll comes one interval after the first pull started: a pull that ends
        # sooner (most failed ones, an image the runtime already has) costs the runtime none.
        while True:
            await asyncio.sleep(self.cfg.progress_interval_seconds)
            if not ((self.running or self.cleanups) and self.enabled and not self._closed):
                return
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except RpcError as e:  # the runtime is away or refused: try again next time
                logs.log(_log, logging.DEBUG, "pull progress poll failed", code=e.code.name, error=e.details)
            except Exception:  # a bug of ours must not stop pulls
                _log.exception("pull progress poll failed")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def tick(self) -> None:
        """One poll of the runtime for every running pull (see module doc for the calls)."""
        self.ticks += 1
        now = self.clock()
        if self.no_api is not None:
            if now - self.no_api_at < NO_API_RECHECK_SECONDS:
                return
            for t in self.running.values():  # ask again (the runtime may have been replaced)
                if t.progress.unknown == self.no_api:
                    t.progress.unknown = None
            self.no_api = None
        try:
            await self._poll(now)
        except NoContentApi as e:
            self._no_content_api(str(e), now)

    async def _poll(self, now: float) -> None:
        active = [t for t in self.running.values() if t.progress.unknown is None]
        ingests = await self.client.list_statuses() if (active or self.cleanups) else []
        by_digest: dict[str, tuple[int, float, str]] = {}
        for i in ingests:
            d = ingest_digest(i.ref)
            if d is not None:
                by_digest[d] = (i.offset, i.started_wall, i.ref)
        await self._abort_leftovers(by_digest, now)
        stored = await self._list(active, by_digest)
        committed = {b.digest: b.created_wall for b in stored}
        await self._resolve(active, stored, by_digest)
        now = self.clock()
        for t in active:
            self._observe(t, now, by_digest, committed)
        if self.cfg.no_progress_timeout_seconds > 0:
            every = frozenset((d, i[0]) for d, i in by_digest.items())
            if every != self.node_ingests:
                self.node_ingests, self.node_moved = every, now
            known = {b.digest for t in self.running.values() if t.progress.manifest for b in t.progress.manifest.blobs}
            orphans = frozenset((d, off) for d, off in every if d not in known)
            for t in active:
                self._watch(t, now, stored, orphans, by_digest.keys())
        self._prune()
        self._publish_gauges()

    # ------------------------------------------------------------------ steps of a tick

    def _no_content_api(self, why: str, now: float) -> None:
        reason = "the runtime has no containerd content API (e.g. CRI-O)"
        if self.no_api is None:
            logs.log(_log, logging.INFO, "pull progress unknown: " + reason, detail=why)
        self.no_api, self.no_api_at = reason, now
        for t in self.running.values():
            t.progress.unknown = reason
        self.cleanups.clear()

    async def _list(self, active: list[Tracked], ingests: dict[str, tuple[int, float, str]]) -> list[Any]:
        filters: list[str] = []
        for t in active:
            p = t.progress
            if p.manifest is None:
                for f in repo_filters(t.host, t.repo) + ([digest_filter(t.digest)] if t.digest else []):
                    if f not in filters:
                        filters.append(f)
            else:
                for b in p.manifest.blobs:
                    if b.digest not in ingests and b.digest not in p.committed:
                        f = digest_filter(b.digest)
                        if f not in filters:
                            filters.append(f)
        return await self.client.list(filters) if filters else []

    async def _resolve(self, active: list[Tracked], stored: list[Any],
                       ingests: dict[str, tuple[int, float, str]]) -> None:
        reads = 0
        taken = {t.progress.manifest.digest: t.ref for t in [*self.running.values(), *self.recent]
                 if t.progress.manifest is not None and t.digest is None}
        for t in active:
            p = t.progress
            if p.manifest is not None:
                continue
            candidates = [StoredManifest.from_labels(b.digest, b.labels, b.touched_wall, t.host) for b in stored
                          if b.labels.get("containerd.io/gc.ref.content.config") is not None
                          or any(k.startswith("containerd.io/gc.ref.content.m.") for k in b.labels)]
            others: dict[str, float] = {}  # other tags of the repository pulled meanwhile -> first start
            for o in [*self.running.values(), *self.recent]:
                if o is not t and o.host == t.host and o.repo == t.repo and o.digest is None \
                        and (o.ended_wall is None or o.ended_wall >= t.started_wall):
                    others[o.ref] = min(others.get(o.ref, o.started_wall), o.started_wall)
            found = resolve(t.repo, t.digest, t.started_wall, others, candidates, ingests.keys(), taken, t.ref)
            if isinstance(found, Unresolved):
                p.pending_reason = found.reason
                continue
            if found not in self.manifests:
                if reads >= MAX_READS_PER_TICK:
                    continue
                reads += 1
                try:
                    self.manifests[found] = parse_manifest(found, await self.client.read(found))
                except (RpcError, ValueError) as e:
                    logs.log(_log, logging.DEBUG, "manifest not readable", digest=found, error=str(e))
                    continue
                while len(self.manifests) > MANIFEST_CACHE:
                    self.manifests.popitem(last=False)
            manifest = self.manifests.get(found)
            if manifest is None:
                p.unknown = f"{found} is not an image manifest the shim can read"
                continue
            p.set_manifest(manifest)
            t.resolved_tick = self.ticks
            taken[found] = t.ref
            logs.log(_log, logging.DEBUG, "pull manifest known", image=t.flight.key.image, manifest=found,
                     layers=len(manifest.layers), bytes=manifest.total)

    def _observe(self, t: Tracked, now: float, ingests: dict[str, tuple[int, float, str]],
                 committed: dict[str, float]) -> None:
        """``committed``: blob -> when it was committed (wall clock)."""
        p = t.progress
        if p.manifest is None or t.resolved_tick == self.ticks:
            return
        mine = {b.digest for b in p.manifest.blobs}
        offsets = {d: ingests[d][0] for d in mine if d in ingests}
        done = mine & committed.keys()
        # what this pull brought in: ingests it started, blobs committed since it started
        fresh = {d for d in offsets if ingests[d][1] >= t.started_wall} | \
                {d for d in done if committed[d] >= t.started_wall}
        steps = p.observe(now, offsets, done, fresh)
        self._count_bytes(p)
        for step in steps:
            self._step(t, step, now)
        if not t.stalled and self.cfg.stall_timeout_seconds > 0:
            stall = p.stall(now, self.cfg.stall_timeout_seconds, self.cfg.stall_min_bytes_per_second)
            if stall is not None:
                self._stalled(t, stall)

    def _watch(self, t: Tracked, now: float, stored: list[Any], orphans: frozenset[tuple[str, int]],
               ingesting: Any) -> None:
        """The no-progress guard for one pull (module doc): end it once nothing it could be
        doing has changed for ``pulls.no_progress_timeout_seconds``."""
        p = t.progress
        token: object
        if p.unknown is not None or t.stalled:
            return
        if p.manifest is None:  # resolving: its repository's manifests, and ingests no known pull owns
            mine = frozenset((b.digest, b.touched_wall) for b in stored if b.digest == t.digest
                             or t.repo in StoredManifest.from_labels(b.digest, b.labels, 0.0, t.host).repos)
            token = ("resolving", mine, orphans)
        elif p.phase == "downloading":
            token = ("downloading", p.bytes_done)
        else:  # the tick that found the manifest, or unpacking: no bytes move, and that is no hang
            token = (p.phase, now)
        if token != t.progress_token:
            t.progress_token, t.last_progress = token, now
            return
        idle = now - t.last_progress
        if idle < self.cfg.no_progress_timeout_seconds:
            return
        own_open = p.manifest is not None and any(b.digest in ingesting for b in p.manifest.blobs)
        if not own_open and now - self.node_moved < self.cfg.no_progress_timeout_seconds:
            return  # maybe waiting for the runtime's downloads of other pulls
        phase = "resolving" if p.manifest is None else p.phase
        message = no_progress_message(t.flight.key.image, self.cfg.no_progress_timeout_seconds, phase,
                                      t.domain, p.bytes_done, p.bytes_total)
        t.stalled = True
        if self.scheduler.fail_running(t.flight, RpcError(STALL_CODE, message)):
            self.events.pull_made_no_progress(phase)
            logs.log(_log, logging.WARNING, "pull made no progress; cancelled", image=t.flight.key.image,
                     phase=phase, registry=t.domain, idle_seconds=round(idle, 1),
                     bytes=f"{human_bytes(p.bytes_done)}/{human_bytes(p.bytes_total)}", waiters=t.flight.waiters)

    def _count_bytes(self, p: FlightProgress, only_seen: bool = False) -> None:
        """cri_shim_pull_bytes_total: each blob's growth counted once node-wide. ``only_seen``:
        skip blobs no poll saw (whether they were there before the pull is not known)."""
        for d, v in p.offsets.items():
            if only_seen and d not in p.baseline:
                continue
            base = self.counted.setdefault(d, p.baseline.get(d, v))
            if v > base:
                self.events.downloaded(v - base)
                self.counted[d] = v

    def _step(self, t: Tracked, step: int, now: float) -> None:
        p = t.progress
        attrs: dict[str, int] = {"cri_shim.pull.percent": step, "cri_shim.pull.bytes_done": p.bytes_done,
                                    "cri_shim.pull.bytes_total": p.bytes_total,
                                    "cri_shim.pull.layers_done": p.layers_done,
                                    "cri_shim.pull.layers_total": p.layers_total}
        for listener in list(t.flight.listeners):
            with contextlib.suppress(Exception):
                listener(f"pull {step}%", attrs)
        running = now - p.started
        level = logging.INFO if running >= self.cfg.progress_log_after_seconds else logging.DEBUG
        rate = p.rate(now)
        logs.log(_log, level, "pull progress", image=t.flight.key.image, percent=step,
                 bytes=f"{human_bytes(p.bytes_done)}/{human_bytes(p.bytes_total)}",
                 layers=f"{p.layers_done}/{p.layers_total}", rate="-" if rate is None else f"{human_bytes(rate)}/s",
                 waiters=t.flight.waiters, running_seconds=round(running, 1))

    def _stalled(self, t: Tracked, stall: Any) -> None:
        message = stall_message(t.flight.key.image, stall, self.cfg.stall_min_bytes_per_second)
        t.stalled = True
        if self.scheduler.fail_running(t.flight, RpcError(STALL_CODE, message)):
            self.events.pull_stalled()
            logs.log(_log, logging.WARNING, "pull stalled; cancelled", image=t.flight.key.image,
                     moved_bytes=stall.moved, window_seconds=stall.window,
                     min_bytes_per_second=self.cfg.stall_min_bytes_per_second, waiters=t.flight.waiters)

    async def _abort_leftovers(self, ingests: dict[str, tuple[int, float, str]], now: float) -> None:
        """A stalled pull's ingests that no running pull needs are aborted once its call ended."""
        if not self.cleanups:
            return
        needed = {b.digest for r in self.running.values() if r.progress.manifest for b in r.progress.manifest.blobs}
        aborts = 0
        for c in list(self.cleanups):
            left = {d for d in c.blobs - needed if d in ingests}
            for d in sorted(left):
                if aborts >= MAX_ABORTS_PER_TICK:
                    break
                aborts += 1
                ref = ingests[d][2]
                try:
                    await self.client.abort(ref)
                    logs.log(_log, logging.INFO, "stalled pull's ingest aborted", ref=ref)
                except RpcError as e:
                    logs.log(_log, logging.DEBUG, "ingest abort failed", ref=ref, code=e.code.name)
            if not left or now > c.until:
                self.cleanups.remove(c)

    def _prune(self) -> None:
        if not self.running:
            self.recent.clear()
        else:
            oldest = min(t.started_wall for t in self.running.values())
            self.recent = [t for t in self.recent if (t.ended_wall or 0) >= oldest]
        live = {b.digest for t in self.running.values() if t.progress.manifest for b in t.progress.manifest.blobs}
        for d in [d for d in self.counted if d not in live]:
            del self.counted[d]

    def _publish_gauges(self) -> None:
        known = [t.progress for t in self.running.values() if t.progress.known]
        self.events.in_flight_bytes(sum(p.bytes_done for p in known), sum(p.bytes_total for p in known))


def _source_host(domain: str) -> str:
    """The host as containerd writes it in ``containerd.io/distribution.source.<host>``: no port."""
    if domain.startswith("["):
        return domain[1:domain.index("]")]
    return domain.rsplit(":", 1)[0] if ":" in domain else domain


__all__ = ["ProgressPoller", "STALL_CODE", "stall_window"]
