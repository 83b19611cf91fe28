"""The controller's watch of MCO's PinnedImageSets (shim/controller/pinned.py) against an in-process
fake API server (tests/support/fake_kube.py): nothing of MCO's is listed while discovery says it is
not served; once served, PinnedImageSets, pools and our reports are watched, and each change queues
only the sets it concerns (work costs the change, not the sets)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kubernetes_asyncio.client import CustomObjectsApi

from shim.controller.apply import Applier
from shim.controller.pinned import PinnedImageSetReconciler, PinnedWatch
from shim.controller.workqueue import WorkQueue
from tests.support.fake_kube import FakeKube
from tests.unit.test_cluster_api import MCO, MCP_V1, PIS_V1, group, kube, never, resources  # noqa: F401
from tests.support.wait import wait_for
from tests.unit.test_cluster_source import pis, pool

REPORTS = "/apis/cri-shim.io/v1/pinnedimagesetreports"


def take(q: WorkQueue[str]) -> list[str]:
    """The names queued, sorted, as the manager's loop takes a batch (none queued afterwards)."""
    batch = []
    while (name := q.get_nowait()) is not None:
        batch.append(name)
        q.done(name)
    return sorted(batch)


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


async def test_nothing_listed_until_served_then_each_change_marks_its_sets(kube: FakeKube) -> None:
    api = kube.client()
    nodes = SimpleNamespace(items={n["metadata"]["name"]: n for n in (node("w1", role="worker"), node("i1", role="infra"))})
    statuses = SimpleNamespace(items={})
    common: dict[str, Any] = dict(on_change=lambda: None, reach=never(), watch_timeout=300.0, request_timeout=5.0,
                                  backoff_initial=1.0, backoff_max=30.0)
    queue: WorkQueue[str] = WorkQueue()
    p = PinnedWatch(api, queue.add, informer_args=common, request_timeout=5.0, discovery_interval=0.1)
    applier = Applier(CustomObjectsApi(api), 5.0)
    reconciler = PinnedImageSetReconciler(p, nodes=nodes, statuses=statuses, applier=applier,  # type: ignore[arg-type]
                                          leading=lambda: False, stale_after=120.0)
    task = asyncio.get_running_loop().create_task(p.run())
    try:
        await wait_for(lambda: kube.count(f"/apis/{MCO}") >= 3, what="discovery asked again while not served")
        assert not any(path.startswith(f"/apis/{MCO}/") or path == REPORTS for path, _ in kube.requests)
        assert p.synced and p.sets == {} and p.kinds is None

        kube.put(PIS_V1, pis("a", ["reg/a:1"]))
        kube.put(PIS_V1, pis("b", ["reg/b:1"]))
        kube.put(MCP_V1, pool("worker", {"matchLabels": {"role": "worker"}}, ["a"]))
        kube.put(MCP_V1, pool("infra", {"matchLabels": {"role": "infra"}}, ["b"]))
        kube.collections[REPORTS] = {}
        kube.discovery[f"/apis/{MCO}"] = group("v1")
        kube.discovery[f"/apis/{MCO}/v1"] = resources("machineconfigpools", "pinnedimagesets")
        await wait_for(lambda: p.synced and len(p.informers) == 3 and set(p.sets) == {"a", "b"}, what="watched once served")
        await wait_for(lambda: queue.queued() == {"a", "b"}, what="the lists mark every set")
        take(queue)

        p.node_moved({"role": "db"}, {"role": "worker"})  # relabelled into the worker pool
        assert take(queue) == ["a"]
        p.status_changed(None, {"status": {"sets": [{"name": "b", "kind": "PinnedImageSet"},
                                                    {"name": "a", "kind": "ImageSet"}]}}, None)
        assert take(queue) == ["b"]  # an ImageSet row of the same name is not this set's

        kube.put(MCP_V1, {**pool("infra", {"matchLabels": {"role": "infra"}}, ["b"]), "status": {"machineCount": 2}})
        kube.put(PIS_V1, pis("c", ["reg/c:1"]))  # an event after the pool's: the pool's has been seen
        await wait_for(lambda: "c" in queue.queued(), what="the new set marked")
        assert take(queue) == ["c"]  # MCO writing the pool's status marks nothing
        kube.put(MCP_V1, pool("infra", {"matchLabels": {"role": "infra"}}, ["c"]))  # lists c instead of b
        await wait_for(lambda: queue.queued() == {"b", "c"}, what="the sets listed before and after")
        take(queue)

        await reconciler.reconcile("a")  # computed, not written: not leading
        assert applier.writes == 0 and not any(path.startswith(REPORTS + "/") for path, _ in kube.requests)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
