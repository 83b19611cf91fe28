"""This node's NodeImageSetStatus as the API server holds it (shim/cluster/node_report.py), against
the in-process fake API server (tests/support/fake_kube.py), which answers a first server-side
apply 201 (created) as the real one does: the Events of the first write are sent (the object's
uid is read from that answer); the object deleted, or changed by another writer, is written again
at the next interval while the node is at rest; at rest, nothing more is written."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import CustomObjectsApi

from shim.cluster.node_report import NodeReport
from shim.cluster.reachability import Reachability
from tests.support.fake_kube import FakeKube
from tests.support.wait import wait_for
from tests.unit.test_cluster_api import kube  # noqa: F401  (kube: a fixture)
from tests.unit.test_cluster_refused import GOOD, UPPER, informer, source, versioned
from tests.unit.test_cluster_source import node, own
from tests.unit.test_imagesets import image_sets, reconciled, store  # noqa: F401  (store: a fixture)

NIS = "/apis/cri-shim.io/v1/nodeimagesetstatuses"
EVENTS = "/api/v1/namespaces/default/events"


async def test_first_write_has_its_events_and_a_deleted_or_changed_object_is_written_again(
        runtime, store, kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    store.add(*GOOD)
    sets_dir = tmp_path / "sets"
    sets_dir.mkdir()
    kube.collections[NIS]  # served, empty: no status object yet  # noqa: B018
    async with image_sets(runtime, sets_dir) as h:
        src, _ = source(tmp_path, h.sets, h.metrics)
        # the first document already holds a failure: a set refused (an image name the shim refuses)
        src.informers = {"node": informer([node({})]),
                         "imagesets": informer([versioned(own("keep", GOOD, pin=True), 1),
                                                versioned(own("bad", [UPPER]), 1)])}
        src.recompute()
        await reconciled(h, "keep", 3)
        src.api = kube.client()
        src.reach = Reachability(None, probe_interval=1.0, request_timeout=5.0)
        st = NodeReport(src, h.sets, None, interval=0.2, event_interval=300, event_namespace="default",
                        request_timeout=5)
        st.start()
        try:
            await wait_for(lambda: kube.writes, what="the first status write")
            assert kube.writes[0] == ("PATCH", f"{NIS}/n1", 201)  # created
            stored = kube.collections[NIS]["n1"]
            event = await wait_for(lambda: next(iter(kube.collections[EVENTS].values()), None),
                                what="the first write's Event")
            assert event["reason"] == "ImageSetInvalid" and "image set bad" in event["message"]
            assert event["involvedObject"]["uid"] == stored["metadata"]["uid"] and st.uid
            await wait_for(lambda: st.own is not None and st.own.synced and "n1" in st.own.items,
                        what="its own object watched")
            first = stored["status"]

            # deleted by hand while the node is at rest: written again, as it was
            kube.remove(NIS, "n1")
            await wait_for(lambda: "n1" in kube.collections[NIS], what="the object written again")
            again = kube.collections[NIS]["n1"]
            assert again["metadata"]["uid"] != stored["metadata"]["uid"] and again["status"] == first
            await wait_for(lambda: st.restores == 1, what="the restore counted (after its write's answer)")
            assert kube.writes[-1] == ("PATCH", f"{NIS}/n1", 201)
            await wait_for(lambda: st.uid == again["metadata"]["uid"], what="Events go to the new object")

            # another writer changes what the node wrote: written back
            await wait_for(lambda: st.own is not None and st.own.items.get("n1", {}).get("status") == first,
                        what="the new object watched")
            kube.put(NIS, {**again, "status": {"nodeName": "n1", "sets": []}})
            await wait_for(lambda: kube.collections[NIS]["n1"]["status"] == first, what="the status written back")
            await wait_for(lambda: st.restores == 2, what="the second restore counted")
            assert st.status()["restored"] == 2

            # at rest: nothing more (the object holds what was written; the watch saw the writes)
            n = len(kube.writes)
            await asyncio.sleep(1.5)
            assert [w for w in kube.writes[n:] if w[0] == "PATCH"] == []
        finally:
            await st.stop()


async def test_a_status_watch_that_rbac_refuses_is_said_once_and_writes_go_on(
        runtime, store, kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    """An older role without list/watch on nodeimagesetstatuses: the status is written as before."""
    store.add(*GOOD)
    sets_dir = tmp_path / "sets"
    sets_dir.mkdir()
    kube.fail(NIS, 403)
    async with image_sets(runtime, sets_dir) as h:
        src, _ = source(tmp_path, h.sets, h.metrics)
        src.informers = {"node": informer([node({})]),
                         "imagesets": informer([versioned(own("keep", GOOD, pin=True), 1)])}
        src.recompute()
        await reconciled(h, "keep", 3)
        src.api = kube.client()
        src.reach = Reachability(None, probe_interval=1.0, request_timeout=5.0)
        st = NodeReport(src, h.sets, None, interval=0.2, event_interval=300, event_namespace="default",
                        request_timeout=5)
        st.start()
        try:
            await wait_for(lambda: "n1" in kube.collections[NIS], what="the status written")
            assert st.status()["watch_error"].startswith("HTTP 403")
            assert st.restore_due() == ""  # nothing known: no write on a guess
        finally:
            await st.stop()


async def test_events_need_the_uid_the_first_apply_answers(kube: FakeKube) -> None:
    """The client's own model returns no body for a 201; the status writer reads it."""
    api = kube.client()
    kube.collections[NIS]  # noqa: B018
    body = {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": "n9"}}
    plain: Any = await CustomObjectsApi(api).patch_cluster_custom_object(  # type: ignore[call-arg]
        "cri-shim.io", "v1", "nodeimagesetstatuses", "n9", body, field_manager="x", force=True,
        _content_type="application/apply-patch+yaml")
    assert plain is None  # why node_report.py reads the answer itself


async def test_a_set_turning_current_is_written_at_once_not_at_the_next_interval(
        runtime, store, kube: FakeKube, tmp_path: Path) -> None:  # noqa: F811
    """A paced rollout frees a node's slot when the controller reads the node current: the write
    that says so does not wait for cluster.status_interval_seconds (a minute here), even while
    the writer waits out the rest of its interval after another change."""
    store.add("reg/a:1")
    gate = store.hold("reg/b:1")  # pulled, held until the gate opens
    sets_dir = tmp_path / "sets"
    sets_dir.mkdir()
    kube.collections[NIS]  # noqa: B018
    async with image_sets(runtime, sets_dir) as h:
        src, _ = source(tmp_path, h.sets, h.metrics)
        src.informers = {"node": informer([node({})]),
                         "imagesets": informer([versioned(own("web", ["reg/a:1", "reg/b:1"]), 1)])}
        src.recompute()
        src.changed.set()  # as its apply loop does after applying
        src.api = kube.client()
        src.reach = Reachability(None, probe_interval=1.0, request_timeout=5.0)
        st = NodeReport(src, h.sets, None, interval=60, event_interval=300, event_namespace="default",
                        request_timeout=5)
        st.start()
        try:
            def row() -> dict[str, Any]:
                obj = kube.collections[NIS].get("n1") or {}
                return next(iter((obj.get("status") or {}).get("sets") or []), {})

            await wait_for(lambda: row().get("desiredGeneration") == "1", what="the first write")
            assert "currentGeneration" not in row() and row()["images"]["present"] == 1
            writes = len(kube.writes)
            src.changed.set()  # something else changed: the writer now waits out the rest of its interval
            await asyncio.sleep(0.3)
            gate.set()
            await wait_for(lambda: row().get("currentGeneration") == "1", what="current, long before the interval")
            assert [w[0] for w in kube.writes[writes:]] == ["PATCH"]  # that one write
        finally:
            await st.stop()
