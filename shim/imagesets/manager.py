"""Image sets: the directory, its watcher and the reconciler, started and stopped together.

Pins come from the pin ledger (ledger.py) alone: after every change of the sets, the versions the
reconciler accepted (and the newer versions a source holds back for a grant) are put in it, and
an entry goes only when its source confirms the set is gone (``_gone``). The pins in force are
handed to the image service (``on_pins``) once the directory, when there is one, has been read.

The last valid content of each file of the directory is kept in ``image_sets.state_file``
(shim/imagesets/state.py): loaded before the shim serves (``load_state``), saved when the
content in force of a file changes. A state file that cannot be written is an error in the
log, in ``cri-shim status`` and in metrics, at start and on every failed save; a failed save is
tried again every ``image_sets.retry_max_seconds`` (at least 1 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import ImageSetsConfig
from ..credentials.dockerconfig import DockerConfigFiles
from ..credentials.prefetch import PrefetchCredentials, SetCredentials
from ..cri.upstream import Upstream
from ..images.pin_set import PinSet
from ..observability import logs
from ..pins.declared_pins import PinsSnapshot
from ..pins.ledger import Entry, PinLedger
from ..pulls.scheduler import PullScheduler
from . import state
from .events import ImageSetEvents
from .loader import ImageSet, SetDirectory
from .parse_process import ParseProcess
from .prefetch import HandlerFor, Prefetch
from .reconciler import Environment, Reconciler
from .report import PinsView
from .snapshot import Snapshot
from .watcher import POLL_SECONDS, DirWatcher

_log = logs.get("imagesets")
PinSink = Callable[[PinsSnapshot], None]  # normalized ref -> the set pinning it (the ledger's snapshot)
FILE_SOURCE = "file"


@dataclass(frozen=True)
class SourceSets:
    """What a source other than the directory declares for this node (``ImageSets.set_source``)."""

    sets: dict[str, ImageSet]  # in force: read now, or kept (a refused set's last valid version)
    held: dict[str, ImageSet] = field(default_factory=dict)  # newer versions waiting for a grant: pinned, not pulled
    uids: Mapping[str, str] = field(default_factory=dict)  # set -> its object's metadata.uid
    fresh: frozenset[str] | None = None  # sets whose version was read now (not kept or from a state file); None: all
    present: frozenset[str] = frozenset()  # every set the source still declares here, valid or not
    decided: tuple[str, ...] = ()  # origins (prefixes) it read whole now: an entry of one of them not present is gone

    def is_fresh(self, name: str) -> bool:
        return self.fresh is None or name in self.fresh


class ImageSets:
    """Watches ``cfg.dir`` (when set); every settled change re-reads the changed files and re-diffs.

    Other sources (the cluster) hand their sets to ``set_source``; the reconciler gets the union.
    A set name taken by the directory is refused in another source (reported in its errors).
    """

    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, scheduler: PullScheduler, events: ImageSetEvents, *,
                 on_pins: PinSink, ledger: PinLedger | None = None, pins: Callable[[], PinSet] | None = None,
                 handler_for: HandlerFor | None = None, set_credentials: SetCredentials | None = None,
                 env: Environment | None = None, use_inotify: bool = True,
                 poll_seconds: float = POLL_SECONDS) -> None:
        """``ledger``: the node's pin ledger (the process's, loaded already); None: one in memory.
        ``pins``: the pins in force (the image service's), for the pinned counts of a snapshot.
        ``handler_for`` and ``set_credentials``: see prefetch.py and credentials/prefetch.py.
        No file is read here: ``load_state`` and ``start`` read them."""
        self.cfg = cfg
        self.events = events
        self.parser = ParseProcess()  # started at the first file to read: YAML never holds our GIL
        self.directory = SetDirectory(cfg.dir, cfg.max_file_bytes, self.parser.parse)
        self._on_pins = on_pins
        self.ledger = ledger if ledger is not None else PinLedger("")
        self._ledgered: dict[str, ImageSet] = {}  # set -> the version put in the ledger last (by identity)
        self._published = -1  # the ledger version handed to on_pins last
        self.credentials = PrefetchCredentials(DockerConfigFiles(cfg.docker_config), set_credentials)
        prefetch = Prefetch(cfg, upstream, scheduler, self.credentials, events, handler_for)
        self.reconciler = Reconciler(cfg, upstream, prefetch, events,
                                     PinsView(pins, self.ledger.covers) if pins is not None else None,
                                     env or Environment())
        self._use_inotify = use_inotify
        self._poll_seconds = poll_seconds
        self.watcher: DirWatcher | None = None
        self.file_errors: dict[str, str] = {}
        self.scans = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._scanned = asyncio.Event()
        self._dir_sets: dict[str, ImageSet] = {}
        self.sources: dict[str, dict[str, ImageSet]] = {}  # source name -> its sets in force
        self._views: dict[str, SourceSets] = {}  # source name -> what it declares (the ledger reads it)
        self.source_errors: dict[str, str] = {}  # set name -> why another source's set of that name is not used
        self._overrides: dict[str, Any] = {}  # ImageSetsConfig fields a source narrows (per-role overrides)
        self.state_error = ""  # why image_sets.state_file cannot be read or written; "" once a save succeeded
        self.state_write_failures = 0  # the start check and every save that failed
        self.loaded_from_state = 0  # files whose last valid text the state file held at start
        self._unsaved = False  # the last save failed: tried again after retry_max_seconds
        events.image_sets_state_error(False)  # not a previous ImageSets' (a reload that changed the dir)

    # ------------------------------------------------------------------ state file

    def load_state(self) -> None:
        """At start, before serving: the last valid content of each file, for the first scan
        (so a file that is invalid then keeps its pins from the first call); and whether the
        state file can be written (said once, clearly, before anything needs saving)."""
        path = self.cfg.state_file
        if not (self.cfg.dir and path):
            return
        try:
            files = state.load(path)
        except ValueError as e:
            self._state_problem(str(e))
            logs.log(_log, logging.ERROR, "image-set state file unusable; the files in image_sets.dir are used as "
                     "they are (an invalid one has no earlier version in force)", error=str(e))
            files = None
        if files is not None:
            self.directory.restore(files, path)
            self.loaded_from_state = len(files)
        try:
            state.probe(path)
        except OSError as e:
            self._write_failed(e)
            logs.log(_log, logging.ERROR, "image-set state file cannot be written: after a restart a file of "
                     "image_sets.dir that is invalid by then loses its sets (under systemd the unit needs "
                     "StateDirectory=cri-shim, or ReadWritePaths= for the file's directory)",
                     file=path, error=self.state_error)

    async def _save(self) -> None:
        path = self.cfg.state_file
        try:
            await asyncio.to_thread(state.save, path, self.directory.accepted())
        except OSError as e:
            self._write_failed(e)
            self._unsaved = True
            logs.log(_log, logging.ERROR, "cannot save the image-set state file; after a restart a file that is "
                     "invalid by then would lose its sets", error=self.state_error,
                     failures=self.state_write_failures, retry_seconds=self.cfg.retry_max_seconds)
            return
        if self._unsaved:
            logs.log(_log, logging.INFO, "image-set state file saved again", file=path)
        self._unsaved = False
        self._state_problem("")

    def _write_failed(self, e: OSError) -> None:
        self.state_write_failures += 1
        self.events.image_sets_state_write_failed()
        self._state_problem(f"{self.cfg.state_file}: cannot write: {e.strerror or e}")

    def _state_problem(self, error: str) -> None:
        self.state_error = error
        self.events.image_sets_state_error(bool(error))

    def _publish(self) -> None:
        """The pins in force (the ledger's) reach the image service once the directory (when there
        is one) has been read: until then the pins the process loaded from the ledger stay and
        removals wait (pins_wait_seconds). The ledger is saved after every change."""
        self.ledger.schedule_save()
        if (self.cfg.dir and self.scans == 0) or self._published == self.ledger.version:
            return
        self._published = self.ledger.version
        self._on_pins(self.ledger.snapshot())

    async def start(self) -> None:
        """Returns at once: the first scan and reconcile run in the background."""
        self.credentials.load_plugins(self.cfg.credential_provider_config, self.cfg.credential_provider_bin_dir)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.reconciler.run(), name="image-sets-reconcile")]
        if self.cfg.dir:
            self.watcher = DirWatcher(self.cfg.dir, self.directory.stamps, poll_seconds=self._poll_seconds,
                                      use_inotify=self._use_inotify)
            self._tasks.append(loop.create_task(self._watch(), name="image-sets-watch"))

    def configure(self, cfg: ImageSetsConfig) -> None:
        """Reload with the same directory and state file (a new one means a new ImageSets)."""
        self.cfg = cfg
        self.directory.configure(cfg.max_file_bytes)
        self.credentials.docker_config.configure(cfg.docker_config)
        self.credentials.load_plugins(cfg.credential_provider_config, cfg.credential_provider_bin_dir)
        self.reconciler.configure(dataclasses.replace(cfg, **self._overrides))

    def set_overrides(self, **overrides: Any) -> None:
        """Narrow ImageSetsConfig fields (e.g. max_parallel, cooldown_seconds) until changed again."""
        if overrides != self._overrides:
            self._overrides = overrides
            self.reconciler.configure(dataclasses.replace(self.cfg, **overrides))

    def set_source(self, name: str, sets: dict[str, ImageSet], *, held: dict[str, ImageSet] | None = None,
                   uids: Mapping[str, str] | None = None, fresh: frozenset[str] | None = None,
                   present: frozenset[str] = frozenset(), decided: tuple[str, ...] = ()) -> None:
        """Another source's sets changed: re-diff the union (see ``SourceSets`` for the arguments)."""
        self.sources[name] = dict(sets)
        self._views[name] = SourceSets(self.sources[name], dict(held or {}), dict(uids or {}), fresh, present, decided)
        self._apply()

    def _apply(self) -> None:
        merged = dict(self._dir_sets)
        errors: dict[str, str] = {}
        for sets in self.sources.values():
            for set_name, s in sets.items():
                if set_name in merged:
                    errors[set_name] = (f"{s.source}: set {set_name!r} is already declared in "
                                        f"{merged[set_name].source}; ignoring it here")
                    continue
                merged[set_name] = s
        self.source_errors = errors
        self.reconciler.set_sets(merged, first=self.ledger)  # the ledger's sets keep their room (max_images)
        self._update_ledger()
        self._publish()

    # ------------------------------------------------------------------ the pin ledger

    def _update_ledger(self) -> None:
        """Put the versions in force (and held ones) in the ledger; drop the sets whose source
        confirms they are gone. Costs the sets (an unchanged version is one identity check),
        and the names of the versions that changed."""
        ledger, done, accepted = self.ledger, self._ledgered, self.reconciler.sets
        held: dict[str, tuple[str, SourceSets, ImageSet]] = {
            n: (src, v, s) for src, v in self._views.items() for n, s in v.held.items()}
        for set_name, s in accepted.items():
            if set_name in held or (done.get(set_name) is s and not self._recreated(set_name)):
                continue
            src, uid, fresh = self._whence(set_name, s)
            if fresh or set_name not in ledger:  # a kept or saved version never replaces a newer one read before
                ledger.put(set_name, src, s.source, uid, s.generation, s.refs, pin=s.pin)
            done[set_name] = s
        for set_name, (src, v, s) in held.items():  # pinned with the version in force until granted
            if done.get(set_name) is not s:
                in_force = accepted.get(set_name)
                refs = s.refs if in_force is None or not in_force.pin else (*s.refs, *in_force.refs)
                ledger.put(set_name, src, s.source, v.uids.get(set_name, ""), s.generation, refs,
                           pin=s.pin or (in_force is not None and in_force.pin))
                done[set_name] = s
        for set_name in [n for n in done if n not in accepted and n not in held]:
            del done[set_name]
        for e in ledger:
            if e.name not in accepted and e.name not in held and (why := self._gone(e)):
                ledger.drop(e.name, e.source, why)

    def _whence(self, set_name: str, s: ImageSet) -> tuple[str, str, bool]:
        """(source, uid, whether this version was read now) of a set in force."""
        if self._dir_sets.get(set_name) is s:
            f = self.directory.files.get(s.source)
            return FILE_SOURCE, "", f is not None and not f.error
        for src, v in self._views.items():
            if (mine := v.sets.get(set_name)) is s or mine == s:  # equal: the reconciler keeps the version it has
                return src, v.uids.get(set_name, ""), v.is_fresh(set_name)
        return FILE_SOURCE, "", False

    def _recreated(self, set_name: str) -> bool:
        """Whether the set in force is now another object's (deleted and created again with the same
        content: the reconciler keeps the version it has, the ledger takes the new uid)."""
        e = self.ledger.get(set_name)
        if e is None or e.source == FILE_SOURCE:
            return False
        v = self._views.get(e.source)
        return v is not None and set_name in v.uids and v.uids[set_name] != e.uid and v.is_fresh(set_name)

    def _gone(self, e: Entry) -> str:
        """Why the source of ``e`` confirms its set is gone, or "" when it does not (or cannot)."""
        if e.source != FILE_SOURCE:
            v = self._views.get(e.source)
            if v is None or e.name in v.present or not e.origin.startswith(v.decided):
                return ""
            return f"{e.origin}: deleted, or no longer selecting this node"
        d = self.directory
        if not self.cfg.dir or self.scans == 0 or d.dir_error:
            return ""  # no directory, not read yet, or unreadable (or missing): nothing is confirmed
        if os.path.dirname(os.path.normpath(e.origin)) != os.path.normpath(self.cfg.dir):
            return ""  # a file of another directory (image_sets.dir changed): nobody confirms it
        f = d.files.get(e.origin)
        if f is None:
            return f"{e.origin}: file removed"
        if not f.error and all(s.name != e.name for s in f.sets):
            return f"{e.origin}: the file no longer declares the set"
        return ""

    async def _watch(self) -> None:
        assert self.watcher is not None
        await self.rescan()
        if self.directory.dir_error:
            logs.log(_log, logging.WARNING, "image set directory unreadable; watching for it",
                     error=self.directory.dir_error)
        while True:
            try:  # after a failed save: rescan (cheap when nothing changed) and save again
                async with asyncio.timeout(max(self.cfg.retry_max_seconds, 1.0) if self._unsaved else None):
                    await self.watcher.wait_settled(self.cfg.debounce_seconds)
            except TimeoutError:
                pass
            await self.rescan()

    async def rescan(self) -> None:
        result = await asyncio.to_thread(self.directory.scan)
        for err in result.new_errors:
            logs.log(_log, logging.ERROR, "image set file rejected; its previous content stays in force",
                     error=err)
        for path in self.file_errors.keys() - result.errors.keys():
            if path in self.directory.files:
                logs.log(_log, logging.INFO, "image set file accepted again", file=path)
        self.file_errors = result.errors
        self.events.invalid_declarations(FILE_SOURCE, len(result.errors))
        first = self.scans == 0
        self.scans += 1
        if result.changed or first:
            self._dir_sets = result.sets
            self._apply()
        if first:
            self._publish()
        self._scanned.set()
        if self.cfg.state_file and (result.accepted_changed or self._unsaved or (first and self.state_error)):
            await self._save()

    def halt(self) -> None:
        """Shutdown begins: no new prefetch, running ones cancelled."""
        for t in self._tasks:
            t.cancel()

    async def stop(self) -> None:
        self.halt()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.reconciler.halt()
        await self.reconciler.drain()
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        await asyncio.to_thread(self.parser.close)
        self.events.image_sets_state_error(False)  # no image sets, no state file
        self.events.invalid_declarations(FILE_SOURCE, 0)  # ... and no file refused

    def snapshot(self) -> Snapshot:
        """What every set in force stands at (typed; costs the number of sets)."""
        return self.reconciler.snapshot()

    @property
    def passes(self) -> int:
        """Runtime reads finished so far (grows by one per pass)."""
        return self.reconciler.passes

    @property
    def completed(self) -> asyncio.Event:
        """Set when a set's images turned all present (its listener clears it)."""
        return self.reconciler.reporter.completed

    def in_force(self, name: str) -> bool:
        """Whether a set of this name is applied now."""
        return name in self.reconciler.sets

    def resync(self) -> None:
        """Read the runtime's images again now."""
        self.reconciler.resync()

    def retry_failed(self) -> None:
        """Credentials changed: retry failed images now."""
        self.reconciler.retry_failed()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dir": self.cfg.dir,
            "watch": self.watcher.mode if self.watcher is not None else "stopped",
            "files": len(self.directory.files),
            "file_errors": dict(self.file_errors),
        }
        if self.sources:
            out["sources"] = {name: len(sets) for name, sets in self.sources.items()}
        if self.source_errors:
            out["source_errors"] = dict(self.source_errors)
        if self._overrides:
            out["overrides"] = dict(self._overrides)
        if self.directory.dir_error:
            out["dir_error"] = self.directory.dir_error
        if self.parser.start_error:
            out["parser_error"] = self.parser.start_error + " (files are parsed in the shim's threads)"
        if self.cfg.state_file:
            out["state_file"] = self.cfg.state_file
            out["loaded_from_state"] = self.loaded_from_state
        if self.state_error:
            out["state_error"] = self.state_error
        if self.state_write_failures:
            out["state_write_failures"] = self.state_write_failures
        out.update(self.reconciler.status())
        kept = sorted(e.name for e in self.ledger if e.name not in self.reconciler.sets)
        out["pin_ledger"] = {**self.ledger.status(), **({"pinned_not_in_force": kept} if kept else {})}
        return out
