"""What the reconciler says about its sets: gauges and progress lines, the typed snapshot, status.

Everything here is built from the counts the table keeps (table.py), so it costs the number
of sets (and of running pulls), never the number of images. A set's gauges and its progress
line (25, 50, 75, 100 %) are published when its counts changed since the last report.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..config import ImageSetsConfig
from ..images.pin_set import PinSet
from ..observability import logs
from .disk import DiskGuard
from .events import ImageSetEvents
from .loader import ImageSet
from .prefetch import Prefetch
from .retries import RetryClock
from .runtime_view import RuntimeView
from .snapshot import COUNTED, Counts, SetSnapshot, Snapshot, State
from .table import DeclaredImage, ImageTable, SetCounts
from .threshold import Pressure

_log = logs.get("imagesets")

PROGRESS_STEPS = (25, 50, 75, 100)
FAILED_ROWS = 20  # failed images listed in status
# (the pins in force's declared part, set, generation) -> whether they hold every name of that version (ledger.covers)
PinnedFully = Callable[[Mapping[str, str], str, str], bool]


@dataclass(frozen=True)
class PinsView:
    """Where a snapshot reads the pins in force (the image service's), and the pin ledger's
    answer to whether they hold every name of a set's version."""
    current: Callable[[], PinSet]
    covers: PinnedFully | None = None


class Reporter:
    def __init__(self, table: ImageTable, events: ImageSetEvents, pins: PinsView | None = None) -> None:
        self._table = table
        self._events = events
        self._pins = pins
        self._progress: dict[str, tuple[str, int]] = {}  # set -> (generation, last step logged)
        # set when a set's counts changed to every declared image present (the status writer
        # listens: a set turning current is said at once, node_report.py)
        self.completed = asyncio.Event()

    def publish(self) -> None:
        """Gauges and progress lines of the sets whose counts changed since the last report."""
        table = self._table
        for name in table.removed:
            self._events.set_removed(name, COUNTED)
            self._progress.pop(name, None)
        table.removed.clear()
        for name in table.changed:
            s = table.sets.get(name)
            if s is None:
                continue
            counts = table.counts(name)
            c = Counts.of(len(s.refs), counts.by_state).as_dict()
            self._events.set_counts(name, c)
            if c["present"] == c["declared"]:
                self.completed.set()
            if counts.by_state[State.UNKNOWN]:
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
        table.changed.clear()

    def _pinned(self, s: ImageSet, counts: SetCounts, pins: PinSet | None) -> int | None:
        """Images of a pinning set that the pins in force match. When the pin ledger says those
        pins hold every name of this version (``PinsView.covers``), that is all of them (no count).
        Otherwise they are counted once per pins object and set generation, not at every snapshot."""
        if not s.pin:
            return None
        if pins is None:
            return len(s.refs)
        covers = self._pins.covers if self._pins is not None else None
        if covers is not None and covers(pins.declared, s.name, s.generation):
            return len(s.refs)
        cached = counts.pinned
        if cached is not None and cached[0] is pins and cached[1] == s.generation:
            return cached[2]
        n = sum(1 for r in s.refs if pins.match([r]) is not None)
        counts.pinned = (pins, s.generation, n)
        return n

    def snapshot(self, pulling: Iterable[DeclaredImage], disk_blocked: str, runtime_error: str,
                 passes: int, pressure: Pressure | None = None) -> Snapshot:
        """What every set stands at now: costs the number of sets (and of ``pulling``, the
        images being pulled)."""
        table = self._table
        pins = self._pins.current() if self._pins is not None else None
        pulled: dict[str, list[str]] = {}
        for img in pulling:
            for name in img.sets:
                pulled.setdefault(name, []).append(img.spelled)
        out: dict[str, SetSnapshot] = {}
        for name in sorted(table.sets):
            s, counts = table.sets[name], table.counts(name)
            c = Counts.of(len(s.refs), counts.by_state)
            blocked = ""
            if c.queued and disk_blocked:
                blocked = disk_blocked
            elif c.queued and pressure is not None:
                blocked = pressure.message()
            elif c.declared != c.present and runtime_error:
                blocked = runtime_error
            last = next(reversed(counts.errored), None)
            out[name] = SetSnapshot(
                name=name, kind=s.kind, source=s.source, generation=s.generation, pin=s.pin, counts=c,
                failed_reasons=dict(counts.reasons), last_error=f"{last.ref}: {last.error}" if last is not None else "",
                blocked=blocked, pinned=self._pinned(s, counts, pins), pulling=tuple(pulled.get(name, ())),
                ignored=s.ignored, runtime_handlers=tuple(sorted({h for h in s.handlers if h})))
        totals = Counts.of(len(table), table.totals)
        return Snapshot(sets=out, totals=totals, refused={n: why for n, (_, why) in sorted(table.refused.items())},
                        disk_blocked=disk_blocked, runtime_error=runtime_error, passes=passes,
                        disk_pressure=({"message": pressure.message(), **pressure.numbers()}
                                       if pressure is not None else None))


def status(snap: Snapshot, *, cfg: ImageSetsConfig, table: ImageTable, retries: RetryClock, disk: DiskGuard,
           runtime: RuntimeView, prefetch: Prefetch, now: float) -> dict[str, Any]:
    """The reconciler's part of `cri-shim status` (image_sets): sets, images, failures, disk, runtime."""
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
    t = snap.totals
    return {
        "sets": sets,
        "refused": dict(snap.refused),
        "max_images": cfg.max_images,
        "declared_entries": table.declared,
        "images": t.by_state(),
        "failed": [{"image": i.ref, **({"runtime_handler": i.handler} if i.handler else {}),
                    "sets": sorted(i.sets), "attempts": i.attempts, "error": i.error, "reason": i.reason,
                    "retry_in_seconds": round(max(0.0, i.retry_at - now), 3)} for i in retries.failing(FAILED_ROWS)],
        "retry_budget": {"per_second": cfg.retry_per_second, "waiting": retries.budget.waiting(),
                         "slowed": retries.budget.slowed()},
        "disk": disk.status(cfg),
        "runtime_error": runtime.error,
        "last_pass": dict(runtime.last_pass),
        "background_pulls_started": prefetch.started,
        "credentials": prefetch.credentials.status(),
    }
