"""``cri-shim controller``: writes each ImageSet's truth (truth.py, report.py) to its status.

Three informers (shim/cluster/informer.py) keep Nodes, ImageSets and NodeImageSetStatuses in
memory, on every replica (a standby's cache is warm when it takes over); a fourth watches the
leader Lease for the elector (leader.py). Only the leader writes. Work follows the change, never a timer over every set:

* an ImageSet event marks that set;
* a Node added, deleted or relabelled marks the sets selecting it before or after;
* a NodeImageSetStatus event marks the sets its rows (and ``worst`` entries) name and those
  selecting its node;
* a (re-)list marks every set;
* an ImageSet whose ``imagePullSecrets`` changed updates the Role nodes read Secrets by (pull_secrets.py);
* a set with a node that turns stale if nothing changes gets one timer, at that due time (work_queue.py).

MCO's PinnedImageSets, when served, get the same truth in PinnedImageSetReports (pinned.py): the
Node and NodeImageSetStatus events above mark them too, and the same batches recompute them.

A paced set (``spec.rollout``) gets its grants here too (grants.py, a pure function of the
nodes' reports and the status last written), written with its status: a node's report of
the generation frees its grant, and the next batch grants the next nodes.

Marked sets are recomputed in batches (at most one batch per ``batch_interval``, 0.5 s): one
rollout wave of a thousand nodes costs a few recomputes per set, not a thousand. A status is
applied only when it differs from the one last written.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from ..cluster.informer import Informer, Obj
from ..cluster.objects import IMAGE_SET, NODE_STATUS, Kind, SelectorError
from ..cluster.reachability import Reachability, readyz
from . import grants, report, rollout, truth
from .apply import Applier
from .leader import LeaderElector
from .pinned import PinnedReports
from .pull_secrets import PullSecretRoles
from .work_queue import WorkQueue


def _lister(custom: CustomObjectsApi, kind: Kind) -> Any:
    return partial(custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)


def _rows(obj: Obj) -> set[str]:
    status = (obj or {}).get("status") or {}
    return {str(r.get("name")) for r in [*(status.get("sets") or []), *(status.get("worst") or [])]}


class Controller:
    def __init__(self, api: ApiClient, elector: LeaderElector, *, stale_after: float = 120.0,
                 batch_interval: float = 0.5, request_timeout: float = 30.0, watch_timeout: float = 300.0,
                 backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 mco_discovery_interval: float = 600.0) -> None:
        self.api = api
        self.elector = elector
        self.stale_after = stale_after
        self.batch_interval = batch_interval
        self.request_timeout = request_timeout
        self.custom = CustomObjectsApi(api)
        # shared by the three watches: backoff, and all resume together once the API server answers again
        self.reach = Reachability(lambda: readyz(api, request_timeout), probe_interval=5.0,
                                  request_timeout=request_timeout)
        common: dict[str, Any] = dict(on_change=lambda: None, reach=self.reach, watch_timeout=watch_timeout,
                                      request_timeout=request_timeout, backoff_initial=backoff_initial,
                                      backoff_max=backoff_max)
        self.nodes = Informer(api, "nodes", CoreV1Api(api).list_node, kind=("v1", "Node"),
                              on_event=self._node_event, **common)
        self.sets = Informer(api, "imagesets", _lister(self.custom, IMAGE_SET),
                             kind=(IMAGE_SET.api_version, IMAGE_SET.kind), on_event=self._set_event, **common)
        self.statuses = Informer(api, "nodeimagesetstatuses", _lister(self.custom, NODE_STATUS),
                                 kind=(NODE_STATUS.api_version, NODE_STATUS.kind), on_event=self._status_event,
                                 **common)
        # the leader Lease, watched so that a standby sees each renewal as it happens (leader.py)
        self.lease = elector.lease_informer(self.reach, watch_timeout=watch_timeout, request_timeout=request_timeout,
                                            backoff_initial=backoff_initial, backoff_max=backoff_max)
        self.secret_roles = PullSecretRoles(api, request_timeout=request_timeout)  # nodes read what sets name
        self._wake = asyncio.Event()
        self.work = WorkQueue(self._wake)
        self.applier = Applier(self.custom, request_timeout)
        self.pinned = PinnedReports(api, self._wake, self.applier, leading=lambda: self.elector.leading,
                                    nodes=self.nodes,
                                    statuses=self.statuses, informer_args=common, stale_after=stale_after,
                                    request_timeout=request_timeout, discovery_interval=mco_discovery_interval)
        self._written: dict[str, dict[str, Any]] = {}  # set -> status last applied by this leader
        self._started: dict[str, tuple[Any, float]] = {}  # set -> (generation, first seen): finer than the status
        self._grant_times: dict[str, dict[str, float]] = {}  # set -> granted node -> when this process saw it granted
        self._digests: dict[str, str] = {}  # node -> truth.expected_digest, for nodes with omitted rows
        self.recomputes = 0

    # ------------------------------------------------------------------ what changed

    def mark(self, *names: str) -> None:
        self.work.mark(*names)

    def _mark_all(self) -> None:
        self.mark(*self.sets.items)

    def _selecting(self, labels: dict[str, str]) -> list[str]:
        return [n for n, s in self.sets.items.items() if truth.selects_node(s, labels)]

    def _expected(self, node: str) -> str:
        """What a node reporting sets in aggregate should digest (cached until a set or its labels change)."""
        if node not in self._digests:
            labels = truth.node_labels(self.nodes.items.get(node) or {})
            self._digests[node] = truth.expected_digest(self.sets.items, labels)
        return self._digests[node]

    def _set_event(self, kind: str, old: Obj, new: Obj) -> None:
        self._digests.clear()
        if kind == "LIST":
            self.secret_roles.relisted(self.sets.items)
            self._mark_all()
            return
        name = str(((new or old) or {}).get("metadata", {}).get("name"))
        self.secret_roles.set_changed(name, new)
        if kind == "DELETED":
            self._wake.set()
            self._forget(name)
            return
        self.mark(name)

    def _node_event(self, kind: str, old: Obj, new: Obj) -> None:
        self._digests.pop(str(((new or old) or {}).get("metadata", {}).get("name")), None)
        if kind == "LIST":
            self._digests.clear()
            self._mark_all()
            self.pinned.mark_all()
            return
        before = truth.node_labels(old) if old is not None else None
        after = truth.node_labels(new) if new is not None else None
        if before == after:
            return  # a status heartbeat: nothing a set looks at
        self.pinned.node_moved(before, after)
        names = set(self._selecting(before)) if before is not None else set()
        if after is not None:
            names.update(self._selecting(after))
        self.mark(*names)

    def _status_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self._mark_all()
            self.pinned.mark_all()
            return
        obj = new or old or {}
        node = self.nodes.items.get(str(obj.get("metadata", {}).get("name")))
        self.pinned.status_changed(old, new, truth.node_labels(node) if node is not None else None)
        names = (_rows(old) | _rows(new)) & set(self.sets.items)
        if node is not None:
            names.update(self._selecting(truth.node_labels(node)))
        self.mark(*names)

    def _forget(self, name: str) -> None:
        self.work.forget(name)
        self._written.pop(name, None)
        self._started.pop(name, None)
        self._grant_times.pop(name, None)

    # ------------------------------------------------------------------ acting (leader only)

    async def reconcile(self, name: str) -> None:
        obj = self.sets.items.get(name)
        if obj is None:
            self._forget(name)
            return
        view = {**obj, "status": self._written.get(name, obj.get("status") or {})}
        if (view["status"].get("observedGeneration") != obj["metadata"].get("generation")
                and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"].get("generation")):
            view["status"] = obj.get("status") or {}  # another leader wrote since: its times hold
        now = time.time()
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
        self.work.schedule(name, t.next_due)
        status = report.status_of(view, t, started=started, now=now, decision=decision, rollout_error=rollout_error)
        if report.unchanged(view, status) or not self.elector.leading:
            return
        if await self.applier.apply(IMAGE_SET, name, report.apply_body(name, status), status=True,
                                    what="the image set's status", retry=self.mark):
            self._written[name] = status

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
        return grants.decide(ro, labels, reports, grants.Previous.read(view["status"], gen),
                             resume=rollout.resume_token(view), now=now, stale_after=self.stale_after,
                             granted_at=self._grant_times.get(view["metadata"]["name"], {})), "", reports

    async def lead(self) -> None:
        """The leader's work, cancelled when leadership is lost."""
        self._written.clear()
        self._mark_all()
        self.pinned.mark_all()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not (self.nodes.synced and self.sets.synced and self.statuses.synced):
                    continue  # each informer's list marks every set once it is synced
                for name in self.work.take():
                    await self.reconcile(name)
                if self.pinned.synced:  # each of its informers' lists marks every PinnedImageSet
                    for name in self.pinned.work.take():
                        await self.pinned.reconcile(name)
                if self.secret_roles.dirty and not await self.secret_roles.sync():
                    asyncio.get_running_loop().call_later(5.0, self._wake.set)
                await asyncio.sleep(self.batch_interval)
        finally:
            self.work.stop()
            self._written.clear()
            self.secret_roles.lost_lead()
            self.pinned.lost_lead()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(inf.run(), name=f"controller-watch-{inf.name}")
                 for inf in (self.nodes, self.sets, self.statuses, self.lease)]
        tasks.append(loop.create_task(self.pinned.run(), name="controller-mco"))
        try:
            await self.elector.run(self.lead)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.reach.stop()
