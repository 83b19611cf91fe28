"""The truth of MCO's ``PinnedImageSet``s, written to ``PinnedImageSetReport``s (ours: MCO owns
the sets' status), for ``cri-shim controller``.

Only when the API server serves MCO's pinned sets (shim/cluster/discovery.py ``mco_kinds``, as the
node's shim asks): at start, then every ``discovery_interval`` while they are not served or a
watch of them fails. Nothing is listed or watched otherwise. When served: informers on
PinnedImageSets, MachineConfigPools and our reports, on every replica; only the leader writes.

A set's nodes are those the ``spec.nodeSelector`` of every pool listing it selects (pools.py), and
each node's row of kind ``PinnedImageSet`` in its ``NodeImageSetStatus`` says where it stands:
the same count as an ImageSet's (truth.py, report.py). Not paced: MCO owns the set, and a node's
shim applies it when it sees it (``spec.rollout`` is ours). A node reporting its sets in aggregate
(over ``cluster.status_max_rows``) without a row or ``worst`` entry for the set counts as behind:
the aggregate's digest covers ImageSets only.

Work follows the change, as for ImageSets (controller.py): a PinnedImageSet event marks it; a pool
whose selector or list changed marks the sets it lists before and after; a Node relabelled, added
or deleted marks the sets of the pools selecting it; a NodeImageSetStatus event the PinnedImageSets
its rows name and those of its node's pools; a report event its set (a report deleted by hand is
written again); a re-list every set. One timer per set with a node due to turn stale.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from functools import partial
from typing import Any, Callable

from kubernetes_asyncio.client import ApiClient, CustomObjectsApi

from ..cluster.discovery import mco_kinds
from ..cluster.informer import Informer, Obj, backoff, describe
from ..cluster.objects import PINNED_IMAGE_SETS, PINNED_REPORT, Kind, pool_listed
from ..observability import logs
from . import pools, report, truth
from .apply import Applier
from .work_queue import WorkQueue

_log = logs.get("controller")
KEYS = ("pinnedimagesets", "machineconfigpools", "pinnedimagesetreports")


def _lister(custom: CustomObjectsApi, kind: Kind) -> Any:
    return partial(custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)


def _name(obj: Obj) -> str:
    return str((obj or {}).get("metadata", {}).get("name"))


def _owner_uid(obj: Obj) -> str:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return str(refs[0].get("uid")) if refs else ""


class PinnedReports:
    def __init__(self, api: ApiClient, wake: asyncio.Event, applier: Applier, *, leading: Callable[[], bool],
                 nodes: Informer, statuses: Informer, informer_args: dict[str, Any], stale_after: float,
                 request_timeout: float, discovery_interval: float = 600.0) -> None:
        self.api = api
        self.custom = CustomObjectsApi(api)
        self.applier = applier
        self.leading = leading
        self.nodes = nodes
        self.statuses = statuses
        self.informer_args = informer_args
        self.stale_after = stale_after
        self.request_timeout = request_timeout
        self.discovery_interval = discovery_interval
        self.work = WorkQueue(wake)
        self.kinds: tuple[Kind, Kind] | None = None  # (PinnedImageSet, MachineConfigPool) as served
        self.discovered = False
        self.error = ""
        self.informers: dict[str, Informer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._written: dict[str, dict[str, Any]] = {}  # set -> report status last applied by this leader
        self._started: dict[str, tuple[Any, float]] = {}  # set -> (generation, first seen)

    # ------------------------------------------------------------------ what is watched

    @property
    def synced(self) -> bool:
        """Every watch listed once (none when MCO is not served: nothing to wait for)."""
        return all(inf.synced for inf in self.informers.values())

    @property
    def sets(self) -> dict[str, dict[str, Any]]:
        inf = self.informers.get(KEYS[0])
        return inf.items if inf is not None else {}

    @property
    def pools(self) -> list[dict[str, Any]]:
        inf = self.informers.get(KEYS[1])
        return list(inf.items.values()) if inf is not None else []

    async def run(self) -> None:
        """Discovery, and the watches while MCO's pinned sets are served."""
        failures = 0
        try:
            while True:
                if self.kinds is None or any(inf.error for inf in self.informers.values()):
                    try:
                        kinds = await mco_kinds(self.api, self.request_timeout)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # down, forbidden: ask again with backoff
                        failures += 1
                        self.error = describe(e)
                        await asyncio.sleep(backoff(failures, 1.0, 30.0))
                        continue
                    failures, self.error = 0, ""
                    self._served(kinds)
                await asyncio.sleep(self.discovery_interval * (1 + 0.5 * random.random()))
        finally:
            self._stop_watches()

    def _stop_watches(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self.informers.clear()

    def _served(self, kinds: tuple[Kind, Kind] | None) -> None:
        first, self.discovered = not self.discovered, True
        if kinds == self.kinds and not first and (kinds is None or self._tasks):
            return
        self._stop_watches()
        self.kinds = kinds
        if kinds is None:
            logs.log(_log, logging.INFO if first else logging.WARNING,
                     "MCO's PinnedImageSets are not served; no PinnedImageSetReport is written; asking again later",
                     every_seconds=self.discovery_interval)
            return
        logs.log(_log, logging.INFO, "MCO's PinnedImageSets are served; watching them and their pools",
                 version=kinds[0].api_version)
        loop = asyncio.get_running_loop()
        events = (self._set_event, self._pool_event, self._report_event)
        for key, kind, on_event in zip(KEYS, (*kinds, PINNED_REPORT), events):
            inf = Informer(self.api, f"{kind.plural}.{kind.version}", _lister(self.custom, kind),
                           kind=(kind.api_version, kind.kind), on_event=on_event, **self.informer_args)
            self.informers[key] = inf
            self._tasks[key] = loop.create_task(inf.run(), name=f"controller-watch-{key}")

    # ------------------------------------------------------------------ what changed

    def mark_all(self) -> None:
        self.work.mark(*self.sets)

    def _set_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self.mark_all()
        elif kind == "DELETED":  # its report goes with it (owner reference)
            self._forget(_name(old))
        else:
            self.work.mark(_name(new))

    def _pool_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self.mark_all()
        elif pools.spec_changed(old, new):
            names = {n for p in (old, new) if p is not None for n in pool_listed(p.get("spec") or {})}
            self.work.mark(*(names & self.sets.keys()))

    def _report_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self.mark_all()
        elif _name(new or old) in self.sets:
            self.work.mark(_name(new or old))

    def node_moved(self, before: dict[str, str] | None, after: dict[str, str] | None) -> None:
        """A Node added, deleted or relabelled: the sets of the pools selecting it before or after."""
        ps = self.pools
        names = set()
        for labels in (before, after):
            if labels is not None:
                names |= pools.sets_selecting(ps, labels)
        self.work.mark(*(names & self.sets.keys()))

    def status_changed(self, old: Obj, new: Obj, labels: dict[str, str] | None) -> None:
        """A NodeImageSetStatus event: the sets its rows name, and those of its node's pools."""
        kind = PINNED_IMAGE_SETS[0].kind
        names = {str(r.get("name")) for obj in (old, new) for key in ("sets", "worst")
                 for r in ((obj or {}).get("status") or {}).get(key) or [] if r.get("kind") == kind}
        if labels is not None:
            names |= pools.sets_selecting(self.pools, labels)
        self.work.mark(*(names & self.sets.keys()))

    def _forget(self, name: str) -> None:
        self.work.forget(name)
        self._written.pop(name, None)
        self._started.pop(name, None)

    def lost_lead(self) -> None:
        self.work.stop()
        self._written.clear()

    # ------------------------------------------------------------------ acting (leader only)

    def _expected(self, node: str) -> str:
        """The PinnedImageSets digest ``node`` writes once it has seen every set its pools list
        (read only for a node whose report aggregates the set: it has more sets than rows)."""
        return pools.expected_digest(self.sets, self.pools, truth.node_labels(self.nodes.items.get(node) or {}))

    async def reconcile(self, name: str) -> None:
        obj = self.sets.get(name)
        if obj is None:
            self._forget(name)
            return
        reports = self.informers[KEYS[2]].items
        present = reports.get(name)
        uid = str(obj["metadata"].get("uid", ""))
        owned = present is not None and _owner_uid(present) == uid  # not one left by a set of the same name
        view = {**obj, "status": self._written.get(name, (present or {}).get("status") or {}) if owned else {}}
        now = time.time()
        gen = obj["metadata"].get("generation")
        seen = self._started.get(name)
        started = seen[1] if seen is not None and seen[0] == gen else report.rollout_start(view, now)
        self._started[name] = (gen, started)
        listing = pools.listing(name, self.pools)
        t = truth.compute(obj, self.nodes.items, self.statuses.items, now=now, changed_at=started,
                          stale_after=self.stale_after, selection=pools.selection(listing), expected=self._expected)
        self.work.schedule(name, t.next_due)
        status = report.status_of(view, t, started=started, now=now)
        body = report.pinned_report_body(obj, status, [str(p["metadata"]["name"]) for p in listing])
        if (owned and report.unchanged(view, body["status"])) or not self.leading():
            return
        if await self.applier.apply(PINNED_REPORT, name, body, status=False, what="the PinnedImageSet's report",
                                    retry=self.work.mark):
            self._written[name] = body["status"]
