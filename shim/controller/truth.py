"""The truth about one ImageSet's rollout, from Nodes x the set's nodeSelector x each node's
``NodeImageSetStatus`` (what shim/cluster/node_report.py writes). Pure: no I/O, times in wall-clock
seconds (the API server's timestamps are wall clock). An MCO PinnedImageSet's the same way, its
nodes those of the MachineConfigPools listing it (``Selection``, pools.py), its rows those of kind
``PinnedImageSet``.

Every selected node is counted in exactly one of:

* ``current``: its report for the set says desired = current = the set's generation;
* ``failing``: its report is at the set's generation and an image failed (``failedReasons``), or
  the node refused that generation or cannot read its pull Secret (the row's ``reason``:
  ``InvalidSet``, ``PullSecretUnavailable``);
* ``missing``: the node has no ``NodeImageSetStatus`` at all (no shim ever reported);
* ``stale``: its report is behind (no row for the set, or a row for another generation) and its
  shim has written nothing for ``stale_after`` seconds since the later of its last write and the
  set's last generation change. A shim writes whenever its counts change (every
  ``cluster.status_interval_seconds`` while it pulls), so a silent one behind is not pulling;
* ``progressing``: anything else (behind, but its shim wrote recently; or pulling).

A node at rest writes nothing, so a current node is never called stale: its report is the
truth until it changes (a dead shim's images may still go; its Node going removes it).

A node with more sets than ``cluster.status_max_rows`` reports the rest in aggregate
(shim/cluster/aggregate.py): a set found in its ``worst`` list is read like a row; a set with
neither a row nor a ``worst`` entry is current there when every omitted set is current and the
node's ``omitted.imageSets`` digest equals the digest of the ImageSets selecting it as seen here
(``expected``); otherwise it counts as behind (progressing, or stale if its shim stays silent).

A paced set (``spec.rollout``, rollout.py) adds ``waiting``: a selected node not granted the
generation (grants.py) that holds its previous version, by its own report (row ``reason:
AwaitingGrant``) or because its shim has not reported the generation yet. A waiting node at
rest writes nothing, so a waiting row never turns stale; a node that never said it waits does,
after ``stale_after``. A granted node's age starts at the grant at the latest (``stale_at``): a
granted node still behind ``stale_after`` after its grant is stale, and no longer holds a
rollout slot (grants.py).
"""

from __future__ import annotations

import datetime as dt
import enum
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

from ..cluster.aggregate import digest
from ..cluster.objects import (
    AWAITING_GRANT,
    FIELD_MANAGER,
    IMAGE_SET,
    PINNED_IMAGE_SETS,
    SelectorError,
    check_selector,
    selects,
)
from ..pulls.failure import REASONS

MAX_LISTED = 20  # failing / stale / missing nodes named in the status, each


def parse_time(s: Any) -> float | None:
    if not isinstance(s, str) or not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def format_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def report_time(status_obj: Mapping[str, Any]) -> float | None:
    """When the node's shim last changed its status object: its field manager's managedFields time
    (the API server moves it only when a write changes something), else the object's creation."""
    meta = status_obj.get("metadata") or {}
    times = [parse_time(m.get("time")) for m in meta.get("managedFields") or [] if m.get("manager") == FIELD_MANAGER]
    known = [t for t in times if t is not None]
    return max(known) if known else parse_time(meta.get("creationTimestamp"))


@dataclass(frozen=True)
class Truth:
    generation: str
    selected: int
    current: int
    progressing: int
    failing: int
    stale: int
    missing: int
    failed_reasons: dict[str, int]  # nodes failing per typed reason (a node may count under several)
    failing_nodes: list[dict[str, str]]  # up to MAX_LISTED, by name
    stale_nodes: list[str]
    missing_nodes: list[str]
    next_due: float | None  # when a node now progressing turns stale (wall clock), if nothing changes
    selector_error: str = ""
    waiting: int = 0  # paced sets: selected nodes waiting for a grant
    # nodes whose prefetch of the set waits below kubelet's image GC threshold: node and its numbers
    pressure_nodes: tuple[tuple[str, str], ...] = ()
    pressure: int = 0

    @property
    def all_current(self) -> bool:
        return self.current == self.selected


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    return dict((node.get("metadata") or {}).get("labels") or {})


@dataclass(frozen=True)
class Selection:
    """The nodes a set selects: those any of ``selectors`` (each named by where it is written)
    selects. An ImageSet: its ``spec.nodeSelector``, absent selecting every node. A PinnedImageSet
    (pools.py): the ``spec.nodeSelector`` of every MachineConfigPool listing it, absent selecting none."""
    selectors: tuple[tuple[str, Mapping[str, Any] | None], ...]
    none_selects_all: bool

    @classmethod
    def of(cls, image_set: Mapping[str, Any]) -> Selection:
        return cls((("spec.nodeSelector", (image_set.get("spec") or {}).get("nodeSelector")),), True)

    def check(self) -> None:
        """SelectorError naming the selector when one cannot be read."""
        for where, selector in self.selectors:
            try:
                check_selector(selector)
            except SelectorError as e:
                raise SelectorError(f"{where}: {e}") from None

    def selects(self, labels: Mapping[str, str]) -> bool:
        """Raises SelectorError for a bad selector (``check`` first to know which)."""
        return any(selects(s, labels, none_selects_all=self.none_selects_all) for _, s in self.selectors)


def selects_node(image_set: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether the set selects a node with these labels; a bad selector selects none."""
    try:
        return Selection.of(image_set).selects(labels)
    except SelectorError:
        return False


def expected_digest(sets: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str]) -> str:
    """The ``omitted.imageSets`` digest a node with these labels writes once it has seen every set."""
    return digest((str(n), str((s.get("metadata") or {}).get("generation", ""))) for n, s in sets.items()
                  if selects_node(s, labels))


_DIGEST_OF = {IMAGE_SET.kind: "imageSets", PINNED_IMAGE_SETS[0].kind: "pinnedImageSets"}  # aggregate.py's omitted.*


def _row(status: Mapping[str, Any], name: Any, expected: Callable[[], str],
         kind: str = IMAGE_SET.kind) -> Mapping[str, Any] | None:
    """The node's row for the set of that kind: its own, its ``worst`` entry, or one implied by
    the aggregate (every omitted set current, and the digest of the sets of that kind the node
    has seen equal to ``expected()``: a shim that writes no digest for the kind implies nothing)."""
    for r in [*(status.get("sets") or []), *(status.get("worst") or [])]:
        if r.get("name") == name and r.get("kind", kind) == kind:
            return dict(r)
    omitted = status.get("omitted")
    field = _DIGEST_OF.get(kind)
    if (field is not None and isinstance(omitted, Mapping) and omitted.get("sets") == omitted.get("current")
            and omitted.get(field) is not None and omitted.get(field) == expected()):
        return {"name": name, "implied": True}
    return None


def _unknown(node: str) -> str:
    return ""


class Report(enum.Enum):
    """What a selected node's own report says about the set's generation, grants aside."""
    MISSING = "missing"  # no NodeImageSetStatus at all
    CURRENT = "current"  # desired = current = the generation
    FAILING = "failing"  # at the generation, an image failed or the version is refused
    PULLING = "pulling"  # at the generation, not yet complete
    WAITING = "waiting"  # the generation declared, the previous version held until a grant
    BEHIND = "behind"  # no row at the generation: its shim has not applied (or seen) it


@dataclass(frozen=True)
class NodeReading:
    report: Report
    due: float | None = None  # WAITING, BEHIND: when it turns stale if its shim stays silent
    reasons: tuple[str, ...] = ()  # FAILING: typed reasons
    error: str = ""
    fetching: bool = False  # WAITING, BEHIND: its row counts images pulling or queued (another generation)
    pressure: str = ""  # PULLING: its images wait below kubelet's image GC threshold (the node's numbers)


def _fetching(row: Mapping[str, Any] | None) -> bool:
    """The row's images pulling or queued: the node fetches the version it has in force (a paced
    set's previous generation while the newest waits for its grant), so it holds a rollout slot."""
    images = (row or {}).get("images") or {}
    return bool(images.get("pulling") or images.get("queued"))


def _pressure(p: Any) -> str:
    """A row's ``diskPressure`` in a few words, with its numbers ("" when none)."""
    if not isinstance(p, Mapping):
        return ""
    gib = 1 << 30

    def n(k: str) -> float:
        v = p.get(k)
        return v / gib if isinstance(v, int) else 0.0
    return (f"used {n('usedBytes'):.2f} GiB, next image {n('sizeBytes'):.2f} GiB, limit {n('thresholdBytes'):.2f} GiB "
            f"(imageGCHighThresholdPercent {p.get('thresholdPercent', '?')}), {p.get('waiting', '?')} waiting")


def stale_at(r: NodeReading, granted_at: float | None, stale_after: float) -> float | None:
    """When a behind or waiting node turns stale if its shim stays silent (wall clock): its
    report's due, and for a node granted at ``granted_at``, not before ``stale_after`` past its
    grant. None for the others (missing, current, pulling, failing: never stale)."""
    if r.due is None:
        return None
    return max(r.due, granted_at + stale_after) if granted_at is not None else r.due


def read_report(obj: Mapping[str, Any] | None, name: Any, generation: str, *, changed_at: float,
                stale_after: float, expected: Callable[[], str] = partial(_unknown, ""),
                kind: str = IMAGE_SET.kind, uid: str = "") -> NodeReading:
    """One node's report for the set ``name`` (of ``kind``) at ``generation``, of the object ``uid``:
    a row naming another object (``uid``: its desiredGeneration's, ``currentUid``: its
    currentGeneration's when another) is a report about a set of the same name deleted since, not
    about this one (rows without uids, from older shims, are read by generation alone)."""
    if obj is None:
        return NodeReading(Report.MISSING)
    row = _row(obj.get("status") or {}, name, expected, kind)
    if row is not None and row.get("implied"):
        return NodeReading(Report.CURRENT)
    if row is not None and uid and row.get("uid") and row.get("uid") != uid:
        row = None  # about another object of that name: this one is not reported yet
    if row is not None and row.get("desiredGeneration") == generation:
        of = row.get("currentUid") or row.get("uid")
        if row.get("currentGeneration") == generation and not (uid and of and of != uid):
            return NodeReading(Report.CURRENT)
        if row.get("reason") == AWAITING_GRANT:
            return NodeReading(Report.WAITING, max(report_time(obj) or changed_at, changed_at) + stale_after,
                               fetching=_fetching(row))
        if row.get("failedReasons") or (row.get("images") or {}).get("failed") or row.get("reason"):
            reasons = sorted({r for r, n in (row.get("failedReasons") or {}).items() if n}
                             | ({str(row["reason"])} if row.get("reason") else set())) or ["other"]
            return NodeReading(Report.FAILING, None, tuple(reasons), str(row.get("error", ""))[:256])
        return NodeReading(Report.PULLING, pressure=_pressure(row.get("diskPressure")))
    return NodeReading(Report.BEHIND, max(report_time(obj) or changed_at, changed_at) + stale_after,
                       fetching=row is not None and not row.get("implied") and _fetching(row))


def read_reports(image_set: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
                 statuses: Mapping[str, Mapping[str, Any]], *, changed_at: float, stale_after: float,
                 expected: Callable[[str], str] | None = None,
                 selection: Selection | None = None) -> dict[str, NodeReading]:
    """Every selected node's report, by node name. Raises SelectorError for a bad selector.
    ``expected(node)``: ``expected_digest`` for the node (the controller caches it).
    ``selection``: which nodes (default: an ImageSet's ``Selection.of``); the rows read are of
    the set's ``kind``."""
    name = (image_set.get("metadata") or {}).get("name")
    uid = str((image_set.get("metadata") or {}).get("uid") or "")
    kind = str(image_set.get("kind") or IMAGE_SET.kind)
    generation = str((image_set.get("metadata") or {}).get("generation", ""))
    sel = selection if selection is not None else Selection.of(image_set)
    sel.check()
    return {n: read_report(statuses.get(n), name, generation, changed_at=changed_at, stale_after=stale_after,
                           expected=partial(expected or _unknown, n), kind=kind, uid=uid)
            for n in sorted(nodes) if sel.selects(node_labels(nodes[n]))}


def compute(image_set: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
            statuses: Mapping[str, Mapping[str, Any]], *, now: float, changed_at: float,
            stale_after: float, expected: Callable[[str], str] | None = None, paced: bool = False,
            granted: Mapping[str, float] | None = None, reports: Mapping[str, NodeReading] | None = None,
            selection: Selection | None = None) -> Truth:
    """``changed_at``: when the set's current generation was first seen (wall clock).
    ``expected(node)``: ``expected_digest`` for the node (the controller caches it).
    ``paced``: the set has a rollout; ``granted``: nodes granted the generation, with when;
    ``reports``: read_reports' answer for the same inputs, when the caller has it already;
    ``selection``: read_reports'."""
    generation = str((image_set.get("metadata") or {}).get("generation", ""))
    if reports is None:
        try:
            reports = read_reports(image_set, nodes, statuses, changed_at=changed_at, stale_after=stale_after,
                                   expected=expected, selection=selection)
        except SelectorError as e:
            return Truth(generation, 0, 0, 0, 0, 0, 0, {}, [], [], [], None, str(e))
    grants = granted or {}
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    failing: list[dict[str, str]] = []
    stale: list[str] = []
    missing: list[str] = []
    pressure: list[tuple[str, str]] = []
    next_due: float | None = None
    for node, r in reports.items():
        if r.report is Report.MISSING:
            missing.append(node)
        elif r.report is Report.FAILING:
            reasons.update(r.reasons)
            failing.append({"node": node, "reasons": ",".join(r.reasons), "error": r.error})
        elif r.pressure:
            pressure.append((node, r.pressure))
        if r.report in (Report.MISSING, Report.CURRENT, Report.FAILING, Report.PULLING):
            counts[{Report.PULLING: "progressing"}.get(r.report, r.report.value)] += 1
            continue
        held = paced and node not in grants
        if held and r.report is Report.WAITING:
            counts["waiting"] += 1  # said so itself: at rest until granted, never stale
            continue
        due = stale_at(r, grants.get(node), stale_after)
        assert due is not None
        if now >= due:
            counts["stale"] += 1
            stale.append(node)
            continue
        next_due = due if next_due is None else min(next_due, due)
        counts["waiting" if held else "progressing"] += 1
    return Truth(generation, len(reports), counts["current"], counts["progressing"], counts["failing"],
                 counts["stale"], counts["missing"],
                 {r: reasons[r] for r in (*REASONS, *sorted(set(reasons) - set(REASONS))) if reasons[r]},
                 failing[:MAX_LISTED], stale[:MAX_LISTED], missing[:MAX_LISTED], next_due, waiting=counts["waiting"],
                 pressure_nodes=tuple(pressure[:MAX_LISTED]), pressure=len(pressure))
