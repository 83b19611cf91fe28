"""The truth about one ImageSet's rollout, from Nodes x the set's nodeSelector x each node's
``NodeImageSetStatus`` (what shim/cluster/node_report.py writes). Pure: no I/O, times in wall-clock
seconds (the API server's timestamps are wall clock).

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
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

from ..cluster.aggregate import digest
from ..cluster.objects import FIELD_MANAGER, SelectorError, check_selector, selects
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

    @property
    def all_current(self) -> bool:
        return self.current == self.selected


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    return dict((node.get("metadata") or {}).get("labels") or {})


def selects_node(image_set: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether the set selects a node with these labels; a bad selector selects none."""
    try:
        return selects((image_set.get("spec") or {}).get("nodeSelector"), labels, none_selects_all=True)
    except SelectorError:
        return False


def expected_digest(sets: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str]) -> str:
    """The ``omitted.imageSets`` digest a node with these labels writes once it has seen every set."""
    return digest((str(n), str((s.get("metadata") or {}).get("generation", ""))) for n, s in sets.items()
                  if selects_node(s, labels))


def _row(status: Mapping[str, Any], name: Any, expected: Callable[[], str]) -> Mapping[str, Any] | None:
    """The node's row for the set: its own, its ``worst`` entry, or one implied by the aggregate."""
    for r in status.get("sets") or []:
        if r.get("name") == name:
            return dict(r)
    for r in status.get("worst") or []:
        if r.get("name") == name:
            return dict(r)
    omitted = status.get("omitted")
    if (isinstance(omitted, Mapping) and omitted.get("sets") == omitted.get("current")
            and omitted.get("imageSets") == expected()):
        return {"name": name, "implied": True}
    return None


def _unknown(node: str) -> str:
    return ""


def compute(image_set: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]],
            statuses: Mapping[str, Mapping[str, Any]], *, now: float, changed_at: float,
            stale_after: float, expected: Callable[[str], str] | None = None) -> Truth:
    """``changed_at``: when the set's current generation was first seen (wall clock).
    ``expected(node)``: ``expected_digest`` for the node (the controller caches it)."""
    name = (image_set.get("metadata") or {}).get("name")
    generation = str((image_set.get("metadata") or {}).get("generation", ""))
    selector = (image_set.get("spec") or {}).get("nodeSelector")
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    failing: list[dict[str, str]] = []
    stale: list[str] = []
    missing: list[str] = []
    next_due: float | None = None
    try:
        check_selector(selector)
        chosen = [n for n, node in nodes.items() if selects(selector, node_labels(node), none_selects_all=True)]
    except SelectorError as e:
        return Truth(generation, 0, 0, 0, 0, 0, 0, {}, [], [], [], None, f"spec.nodeSelector: {e}")
    for node in sorted(chosen):
        obj = statuses.get(node)
        if obj is None:
            counts["missing"] += 1
            missing.append(node)
            continue
        row = _row(obj.get("status") or {}, name, partial(expected or _unknown, node))
        if row is not None and row.get("implied"):
            counts["current"] += 1
            continue
        at_gen = row is not None and row.get("desiredGeneration") == generation
        if at_gen and row is not None and row.get("currentGeneration") == generation:
            counts["current"] += 1
            continue
        if at_gen and row is not None and (row.get("failedReasons") or (row.get("images") or {}).get("failed")
                                           or row.get("reason")):
            counts["failing"] += 1
            node_reasons = sorted({r for r, n in (row.get("failedReasons") or {}).items() if n}
                                  | ({str(row["reason"])} if row.get("reason") else set())) or ["other"]
            reasons.update(node_reasons)
            failing.append({"node": node, "reasons": ",".join(node_reasons), "error": str(row.get("error", ""))[:256]})
            continue
        if not at_gen:  # behind: is its shim silent?
            wrote = report_time(obj) or changed_at
            due = max(wrote, changed_at) + stale_after
            if now >= due:
                counts["stale"] += 1
                stale.append(node)
                continue
            next_due = due if next_due is None else min(next_due, due)
        counts["progressing"] += 1
    return Truth(generation, len(chosen), counts["current"], counts["progressing"], counts["failing"],
                 counts["stale"], counts["missing"],
                 {r: reasons[r] for r in (*REASONS, *sorted(set(reasons) - set(REASONS))) if reasons[r]},
                 failing[:MAX_LISTED], stale[:MAX_LISTED], missing[:MAX_LISTED], next_due)
