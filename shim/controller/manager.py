"""``cri-shim controller``'s manager, in the shape of controller-runtime's: the informers, the
leader elector, one work queue per reconciler (workqueue.py) and the loops that drain them.

Three informers (shim/cluster/informer.py) keep Nodes, ImageSets and NodeImageSetStatuses in
memory, on every replica (a standby's cache is warm when it takes over); a fourth watches the
leader Lease for the elector (leader.py). Only the leader reconciles. Work follows the change,
never a timer over every set; each event queues the names it concerns:

* an ImageSet event queues that set;
* a Node added, deleted or relabelled queues the sets selecting it before or after;
* a NodeImageSetStatus event queues the sets its rows (and ``worst`` entries) name and those
  selecting its node;
* a (re-)list queues every set;
* an ImageSet whose ``imagePullSecrets`` changed queues the Role nodes read Secrets by (pull_secrets.py).

The reconcilers: ``ImageSetReconciler`` (imageset.py: a set's truth, its paced rollout's grants,
its status) and, when MCO's PinnedImageSets are served, ``PinnedImageSetReconciler`` (pinned.py,
whose ``PinnedWatch`` queues the pinned sets the Node and NodeImageSetStatus events above concern).

Each queue's loop takes every ready name at once and reconciles them as one batch; the next
batch starts ``batch_interval`` (0.5 s) after this one started, or as soon as it is done if it
took longer: at most one batch per interval, so one rollout wave of a thousand nodes costs a few
reconciles per set, not a thousand, and a name queued while the queue is idle is reconciled at
once. After each reconcile, as client-go's
controllers do: on success the name's backoff is forgotten, and it is queued again after the
``requeue_after`` it returned (a node turning stale if nothing changes); on an error (a write
that failed) it is queued again after its own backoff (``ItemBackoff``: 5 ms doubling per
failure in a row, at most 30 s), and the log says so once per failure.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Callable

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from ..cluster.informer import Informer, Obj, describe
from ..cluster.objects import IMAGE_SET, NODE_STATUS, Kind
from ..cluster.reachability import Reachability, readyz
from ..observability import logs
from . import truth
from .apply import Applier, WriteError
from .imageset import ImageSetReconciler
from .leader import KubeLeaseLock, LeaderElector
from .pinned import PinnedImageSetReconciler, PinnedWatch
from .pull_secrets import PullSecretRoles
from .reconcile import Reconciler, Result
from .workqueue import ItemBackoff, WorkQueue

_log = logs.get("controller")
BACKOFF_BASE = 0.005  # a failed reconcile of a name is retried after 5 ms, doubling per failure in a row
BACKOFF_CAP = 30.0  # ... to at most 30 s
ROLES = "pull-secret-roles"  # the one item of the Role queue
ROLES_RETRY = 5.0  # a failed Role sync is tried again after this long


def _lister(custom: CustomObjectsApi, kind: Kind) -> Any:
    return partial(custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)


def _rows(obj: Obj) -> set[str]:
    status = (obj or {}).get("status") or {}
    return {str(r.get("name")) for r in [*(status.get("sets") or []), *(status.get("worst") or [])]}


def new_queue() -> WorkQueue[str]:
    return WorkQueue(ItemBackoff(BACKOFF_BASE, BACKOFF_CAP))


async def process(queue: WorkQueue[str], reconciler: Reconciler, name: str) -> None:
    """One reconcile of ``name`` (taken from ``queue``) and what its outcome queues: forget its
    backoff and add it after ``requeue_after`` on success; add it with its backoff on an error."""
    try:
        result = await reconciler.reconcile(name)
    except asyncio.CancelledError:
        raise
    except WriteError as e:
        logs.log(_log, logging.WARNING, f"cannot write {e.what}; will retry", set=name, error=str(e),
                 failures=queue.num_requeues(name) + 1)
        queue.add_rate_limited(name)
    except Exception as e:
        logs.log(_log, logging.ERROR, f"cannot reconcile the {reconciler.kind}; will retry", set=name,
                 error=describe(e), failures=queue.num_requeues(name) + 1)
        queue.add_rate_limited(name)
    else:
        queue.forget(name)
        if result.requeue_after is not None:
            queue.add_after(name, result.requeue_after)
    finally:
        queue.done(name)


class _RolesReconciler:
    """The Role that lets nodes read the pull Secrets sets name (pull_secrets.py), as a reconciler
    of one item: synced when it changed, tried again ``ROLES_RETRY`` after a failure."""

    kind = "pull-secret Role"

    def __init__(self, roles: PullSecretRoles) -> None:
        self.roles = roles

    async def reconcile(self, name: str) -> Result:
        if not self.roles.dirty or await self.roles.sync():
            return Result()
        return Result(ROLES_RETRY)

    def lost_lead(self) -> None:
        self.roles.lost_lead()


class Manager:
    def __init__(self, api: ApiClient, elector: LeaderElector, *, lease: KubeLeaseLock | None = None,
                 stale_after: float = 120.0, batch_interval: float = 0.5, request_timeout: float = 30.0,
                 watch_timeout: float = 300.0, backoff_initial: float = 1.0, backoff_max: float = 30.0,
                 mco_discovery_interval: float = 600.0) -> None:
        """``lease``: the elector's Lease, watched so that a standby sees each renewal as it
        happens (leader.py); None: not watched (the elector polls)."""
        self.api = api
        self.elector = elector
        self.batch_interval = batch_interval
        self.custom = CustomObjectsApi(api)
        # shared by the watches: backoff, and all resume together once the API server answers again
        self.reach = Reachability(lambda: readyz(api, request_timeout), probe_interval=5.0,
                                  request_timeout=request_timeout)
        common: dict[str, Any] = dict(on_change=lambda: None, reach=self.reach, watch_timeout=watch_timeout,
                                      request_timeout=request_timeout, backoff_initial=backoff_initial,
                                      backoff_max=backoff_max)
        self.nodes = Informer(api, "nodes", CoreV1Api(api).list_node, kind=("v1", "Node"),
                              on_event=self.on_node_event, **common)
        self.sets = Informer(api, "imagesets", _lister(self.custom, IMAGE_SET),
                             kind=(IMAGE_SET.api_version, IMAGE_SET.kind), on_event=self.on_set_event, **common)
        self.statuses = Informer(api, "nodeimagesetstatuses", _lister(self.custom, NODE_STATUS),
                                 kind=(NODE_STATUS.api_version, NODE_STATUS.kind), on_event=self.on_status_event,
                                 **common)
        self.lease = (lease.informer(elector.lease_event, self.reach, watch_timeout=watch_timeout,
                                     request_timeout=request_timeout, backoff_initial=backoff_initial,
                                     backoff_max=backoff_max) if lease is not None else None)
        self.secret_roles = PullSecretRoles(api, request_timeout=request_timeout)  # nodes read what sets name
        # the queues: each lead term has its own (a term cancelled mid-reconcile leaves nothing behind)
        self.queue, self.pinned_queue, self.roles_queue = new_queue(), new_queue(), new_queue()
        self.applier = Applier(self.custom, request_timeout)
        leading: Callable[[], bool] = lambda: self.elector.leading  # noqa: E731
        self.imagesets = ImageSetReconciler(nodes=self.nodes, sets=self.sets, statuses=self.statuses,
                                            applier=self.applier, leading=leading, stale_after=stale_after)
        self.pinned_watch = PinnedWatch(api, lambda name: self.pinned_queue.add(name), informer_args=common,
                                        request_timeout=request_timeout, discovery_interval=mco_discovery_interval)
        self.pinned = PinnedImageSetReconciler(self.pinned_watch, nodes=self.nodes, statuses=self.statuses,
                                               applier=self.applier, leading=leading, stale_after=stale_after)
        self.roles = _RolesReconciler(self.secret_roles)

    # ------------------------------------------------------------------ what changed

    def _add(self, *names: str) -> None:
        for name in names:
            self.queue.add(name)

    def _add_all(self) -> None:
        self._add(*sorted(self.sets.items))

    def _roles_changed(self) -> None:
        if self.secret_roles.dirty:
            self.roles_queue.add(ROLES)

    def _selecting(self, labels: dict[str, str]) -> list[str]:
        return [n for n, s in self.sets.items.items() if truth.selects_node(s, labels)]

    def on_set_event(self, kind: str, old: Obj, new: Obj) -> None:
        self.imagesets.sets_changed()
        if kind == "LIST":
            self.secret_roles.relisted(self.sets.items)
            self._roles_changed()
            self._add_all()
            return
        name = str(((new or old) or {}).get("metadata", {}).get("name"))
        self.secret_roles.set_changed(name, new)
        self._roles_changed()
        self._add(name)  # deleted: its reconcile forgets it

    def on_node_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self.imagesets.node_changed(None)
            self._add_all()
            self.pinned_watch.mark_all()
            return
        self.imagesets.node_changed(str(((new or old) or {}).get("metadata", {}).get("name")))
        before = truth.node_labels(old) if old is not None else None
        after = truth.node_labels(new) if new is not None else None
        if before == after:
            return  # a status heartbeat: nothing a set looks at
        self.pinned_watch.node_moved(before, after)
        names = set(self._selecting(before)) if before is not None else set()
        if after is not None:
            names.update(self._selecting(after))
        self._add(*sorted(names))

    def on_status_event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self._add_all()
            self.pinned_watch.mark_all()
            return
        obj = new or old or {}
        node = self.nodes.items.get(str(obj.get("metadata", {}).get("name")))
        self.pinned_watch.status_changed(old, new, truth.node_labels(node) if node is not None else None)
        names = (_rows(old) | _rows(new)) & set(self.sets.items)
        if node is not None:
            names.update(self._selecting(truth.node_labels(node)))
        self._add(*sorted(names))

    # ------------------------------------------------------------------ acting (leader only)

    def _synced(self) -> bool:
        return self.nodes.synced and self.sets.synced and self.statuses.synced

    async def _work(self, queue: WorkQueue[str], reconciler: Reconciler, synced: Callable[[], bool]) -> None:
        """Forever: every ready name as one batch (once the caches it reads are synced: each
        informer's list queues every set), batches at least ``batch_interval`` apart (the time
        the batch took counts: the rest is what remains of the interval)."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            while (name := queue.get_nowait()) is not None:
                batch.append(name)
            while not synced():
                await asyncio.sleep(self.batch_interval)
            began = loop.time()
            for name in sorted(batch):
                await process(queue, reconciler, name)
            rest = began + self.batch_interval - loop.time()
            # always suspend once: a batch that took the whole interval must not run the next one
            # without letting the informers and the lease renewal in (a get() of a ready name does not)
            await asyncio.sleep(max(rest, 0.0))

    async def lead(self) -> None:
        """The leader's work, cancelled when leadership is lost."""
        self.queue, self.pinned_queue, self.roles_queue = new_queue(), new_queue(), new_queue()
        reconcilers: tuple[Reconciler, ...] = (self.imagesets, self.pinned, self.roles)
        for r in reconcilers:
            r.lost_lead()  # what another leader wrote since is read from the caches
        self._add_all()
        self.pinned_watch.mark_all()
        self.roles_queue.add(ROLES)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._work(self.queue, self.imagesets, self._synced), name="controller-imagesets")
                tg.create_task(self._work(self.pinned_queue, self.pinned,
                                          lambda: self._synced() and self.pinned_watch.synced),
                               name="controller-pinnedimagesets")
                tg.create_task(self._work(self.roles_queue, self.roles, self._synced),
                               name="controller-roles")
        finally:
            for q in (self.queue, self.pinned_queue, self.roles_queue):
                q.shutdown()
            for r in reconcilers:
                r.lost_lead()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        informers = [self.nodes, self.sets, self.statuses, *([self.lease] if self.lease is not None else [])]
        tasks = [loop.create_task(inf.run(), name=f"controller-watch-{inf.name}") for inf in informers]
        tasks.append(loop.create_task(self.pinned_watch.run(), name="controller-mco"))
        try:
            await self.elector.run(self.lead)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.reach.stop()
