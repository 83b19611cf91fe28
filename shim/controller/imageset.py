"""The ImageSet reconciler: a set's truth (truth.py), its paced rollout's grants (rollout.py,
grants.py), written to its status (report.py) when it differs from the one last written.

``reconcile(name)`` reads the caches (Nodes, ImageSets, NodeImageSetStatuses), writes the status
through the applier (only while leading) and returns when to look again: the first time a node
of the set turns stale if nothing changes (``Result.requeue_after``), else None. A failed write
raises (apply.py ``WriteError``): the manager's loop retries with the set's backoff. A set gone
from the cache is forgotten. What an event changes, and which sets it concerns, is the
manager's (manager.py)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..cluster.objects import IMAGE_SET, SelectorError
from . import grants, report, rollout, truth
from .apply import Apply
from .reconcile import Result, Store

REQUEUE_SLACK = 0.05  # looked at again this long after a node's due time: it is then past due


class ImageSetReconciler:
    kind = "ImageSet"

    def __init__(self, *, nodes: Store, sets: Store, statuses: Store, applier: Apply, leading: Callable[[], bool],
                 stale_after: float, clock: Callable[[], float] = time.time) -> None:
        self.nodes = nodes
        self.sets = sets
        self.statuses = statuses
        self.applier = applier
        self.leading = leading
        self.stale_after = stale_after
        self._clock = clock
        self._written: dict[str, dict[str, Any]] = {}  # set -> status last applied by this leader
        self._uids: dict[str, str] = {}  # set -> the object's uid the entries here are about
        self._started: dict[str, tuple[Any, float]] = {}  # set -> (generation, first seen): finer than the status
        self._grant_times: dict[str, dict[str, float]] = {}  # set -> granted node -> when this process saw it granted
        self._digests: dict[str, str] = {}  # node -> truth.expected_digest, for nodes with omitted rows
        self.recomputes = 0

    # ------------------------------------------------------------------ caches the events change

    def sets_changed(self) -> None:
        """An ImageSet event or list: every node's expected digest may change."""
        self._digests.clear()

    def node_changed(self, node: str | None) -> None:
        """A Node event (None: a list)."""
        if node is None:
            self._digests.clear()
        else:
            self._digests.pop(node, None)

    def _expected(self, node: str) -> str:
        """What a node reporting sets in aggregate should digest (cached until a set or its labels change)."""
        if node not in self._digests:
            labels = truth.node_labels(self.nodes.items.get(node) or {})
            self._digests[node] = truth.expected_digest(self.sets.items, labels)
        return self._digests[node]

    def _forget(self, name: str) -> None:
        self._written.pop(name, None)
        self._uids.pop(name, None)
        self._started.pop(name, None)
        self._grant_times.pop(name, None)

    def lost_lead(self) -> None:
        self._written.clear()

    # ------------------------------------------------------------------ reconcile

    async def reconcile(self, name: str) -> Result:
        obj = self.sets.items.get(name)
        if obj is None:
            self._forget(name)
            return Result()
        uid = str(obj["metadata"].get("uid") or "")
        if self._uids.get(name, uid) != uid:  # deleted and created again, the deletion unseen (a re-list)
            for memory in (self._written, self._started, self._grant_times):
                memory.pop(name, None)
        self._uids[name] = uid
        view = {**obj, "status": self._written.get(name, obj.get("status") or {})}
        if (view["status"].get("observedGeneration") != obj["metadata"].get("generation")
                and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"].get("generation")):
            view["status"] = obj.get("status") or {}  # another leader wrote since: its times hold
        now = self._clock()
        gen = obj["metadata"].get("generation")
        seen = self._started.get(name)
        started = seen[1] if seen is not None and seen[0] == gen else report.rollout_start(view, now)
        self._started[name] = (gen, started)
        decision, rollout_error, reports = self._grants(view, started, now)
        times = self._grant_times.get(name, {})
        granted = {n: times.get(n, now) for n in decision.granted} if decision is not None else {}
        self._grant_times[name] = granted
        t = truth.compute(obj, self.nodes.items, self.statuses.items, now=now, changed_at=started,
                          stale_after=self.stale_after, expected=self._expected,
                          paced=decision is not None or bool(rollout_error), granted=granted, reports=reports)
        self.recomputes += 1
        result = Result(None if t.next_due is None else max(0.0, t.next_due - now) + REQUEUE_SLACK)
        status = report.status_of(view, t, started=started, now=now, decision=decision, rollout_error=rollout_error)
        if report.unchanged(view, status) or not self.leading():
            return result
        await self.applier.apply(IMAGE_SET, name, report.apply_body(name, status), status=True,
                                 what="the image set's status")
        self._written[name] = status
        return result

    def _grants(self, view: dict[str, Any], started: float,
                now: float) -> tuple[grants.Decision | None, str, dict[str, truth.NodeReading] | None]:
        """A paced set's grants from the status last written (``view``), or why its rollout is
        invalid; and the nodes' reports read for it (None: not read)."""
        try:
            ro = rollout.parse(view.get("spec") or {})
        except rollout.RolloutError as e:
            return None, str(e), None
        if ro is None:
            return None, "", None
        try:
            reports = truth.read_reports(view, self.nodes.items, self.statuses.items, changed_at=started,
                                         stale_after=self.stale_after, expected=self._expected)
        except SelectorError:
            return None, "", None  # the truth says why; no node is selected
        labels = {n: truth.node_labels(self.nodes.items[n]) for n in reports}
        gen = view["metadata"].get("generation")
        return grants.decide(ro, labels, reports, grants.Previous.read(view["status"], gen,
                                                                       str(view["metadata"].get("uid") or "")),
                             resume=rollout.resume_token(view), now=now, stale_after=self.stale_after,
                             granted_at=self._grant_times.get(view["metadata"]["name"], {})), "", reports
