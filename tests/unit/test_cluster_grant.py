"""A node and a paced set (shim/cluster/grant.py, ClusterSource, ImageSets): without a grant the
version in force stays and nothing is pulled, the new generation's present images are pinned at
once; with the grant the missing ones are pulled. Against a scripted runtime, no API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shim import config
from shim.cluster.source import ClusterSource
from shim.cluster.node_report import NodeReport
from shim.observability.metrics import Metrics
from tests.unit.test_cluster_source import fake_informer, node
from tests.unit.test_imagesets import image_sets, reconciled, store  # noqa: F401  (fixture)
from tests.support.wait import wait_for

OLD, NEW, ADDED = "registry.local/app:v1", "registry.local/app:v2", "registry.local/side:v1"


def paced(generation: int, images: list[str], granted: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "cri-shim.io/v1", "kind": "ImageSet",
        "metadata": {"name": "web", "generation": generation, "uid": "u", "resourceVersion": str(generation * 10)},
        "spec": {"pin": True, "images": [{"name": i} for i in images], "rollout": {"maxConcurrentNodes": 1, **extra}}}
    if granted is not None:
        obj["status"] = {"rollout": {"generation": generation, "granted": granted}}
        obj["metadata"]["resourceVersion"] += "1"
    return obj


def recompute(src: ClusterSource, *objs: dict[str, Any]) -> None:
    src.informers = {"node": fake_informer([node({})]), "imagesets": fake_informer(list(objs))}
    src.recompute()


def sets_dir(tmp_path: Path) -> Path:
    (tmp_path / "sets").mkdir()
    return tmp_path / "sets"


def pins(h: Any) -> set[str]:
    return {ref.rsplit("/", 1)[-1] for ref in h.pin_updates[-1]} if h.pin_updates else set()


async def test_without_a_grant_the_version_in_force_stays_and_nothing_new_is_pulled(runtime, store,
                                                                                    tmp_path: Path) -> None:
    store.add(OLD, ADDED)  # ADDED is already on the node (kubelet pulled it for a pod)
    async with image_sets(runtime, sets_dir(tmp_path)) as h:
        cfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "state.json"))
        src = ClusterSource(cfg, h.sets, Metrics())
        recompute(src, paced(1, [OLD], granted=["n1"]))
        await reconciled(h, "web", 1)
        assert store.pulls == [] and pins(h) == {"app:v1"}

        # generation 2 adds NEW (missing) and ADDED (present); n1 is not granted
        recompute(src, paced(2, [NEW, ADDED]))
        await wait_for(lambda: pins(h) == {"app:v1", "app:v2", "side:v1"}, what="new images pinned at once")
        assert src.sets.reconciler.sets["web"].generation == "1" and set(src.held) == {"web"}
        assert store.pulls == []  # nothing of generation 2 pulled, the version in force kept (pinned)
        assert src.status()["awaiting_grant"] == {"web": {"generation": "2", "in_force_generation": "1"}}
        doc = NodeReport(src, h.sets, None, interval=1, event_interval=60, event_namespace="default",
                         request_timeout=5).document()
        row = doc["status"]["sets"][0]
        assert (row["desiredGeneration"], row["currentGeneration"], row["reason"]) == ("2", "1", "AwaitingGrant")
        degraded = next(c for c in doc["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False"  # waiting is not failing
        # the state file keeps the version in force: a restart without the API keeps generation 1
        src.save_state()  # as the apply loop does after each apply
        src2 = ClusterSource(cfg, h.sets, Metrics())
        src2.load_state()
        assert src2.selected["web"].set.generation == "1"

        # granted: generation 2 applies, NEW is pulled, OLD's pin goes with the old version
        recompute(src, paced(2, [NEW, ADDED], granted=["n2", "n1"]))
        await wait_for(lambda: NEW in store.pulls, what="NEW pulled once granted")
        await reconciled(h, "web", 2)
        assert pins(h) == {"app:v2", "side:v1"} and src.held == {}
        # the controller drops n1 from the list once it reports generation 2: it goes on without it
        recompute(src, paced(2, [NEW, ADDED], granted=[]))
        assert src.sets.reconciler.sets["web"].generation == "2" and src.held == {}


async def test_a_generation_that_adds_no_image_needs_no_grant_and_a_new_set_waits_with_nothing(
        runtime, store, tmp_path: Path) -> None:
    store.add(OLD)
    async with image_sets(runtime, sets_dir(tmp_path)) as h:
        cfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "state.json"))
        src = ClusterSource(cfg, h.sets, Metrics())
        recompute(src, paced(1, [OLD, NEW]))  # a new set: nothing in force; OLD present -> pinned, NEW not pulled
        await wait_for(lambda: pins(h) == {"app:v1", "app:v2"}, what="pins without a grant")
        assert "web" not in h.sets.reconciler.sets and store.pulls == []
        recompute(src, paced(1, [OLD, NEW], granted=["n1"]))
        await wait_for(lambda: NEW in store.pulls, what="NEW pulled once granted")
        recompute(src, paced(2, [OLD], failureThreshold=3))  # drops an image, changes the rollout: no grant needed
        assert src.sets.reconciler.sets["web"].generation == "2" and src.held == {}


async def test_a_set_deleted_and_created_again_while_the_shim_was_stopped_is_new(runtime, store,
                                                                                tmp_path: Path) -> None:
    """Issue 45: the shim stopped across `kubectl delete` + `apply` of a paced set; the new object
    starts at generation 1 again. It is another object (uid): applied only with a grant, and its
    row says it waits (its uid; the version in force is the old object's, currentUid)."""
    store.add(OLD)
    async with image_sets(runtime, sets_dir(tmp_path)) as h:
        cfg = config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "state.json"))
        src = ClusterSource(cfg, h.sets, Metrics())
        recompute(src, paced(1, [OLD], granted=["n1"]))
        await reconciled(h, "web", 1)
        src.save_state()  # the shim stops here
        src2 = ClusterSource(cfg, h.sets, Metrics())
        src2.load_state()
        again = paced(1, [OLD, NEW])
        again["metadata"]["uid"] = "u2"
        recompute(src2, again)
        assert src2.sets.reconciler.sets["web"].refs == (OLD,) and set(src2.held) == {"web"}
        await wait_for(lambda: pins(h) == {"app:v1", "app:v2"}, what="the new object's images pinned")
        assert store.pulls == []  # NEW is not pulled without a grant
        row = NodeReport(src2, h.sets, None, interval=1, event_interval=60, event_namespace="default",
                         request_timeout=5).document()["status"]["sets"][0]
        assert (row["desiredGeneration"], row["uid"], row["currentGeneration"], row["currentUid"], row["reason"]) \
            == ("1", "u2", "1", "u", "AwaitingGrant")
        # a grant written for the old object (same name, same generation) grants nothing
        stale = paced(1, [OLD, NEW], granted=["n1"])
        stale["metadata"]["uid"], stale["status"]["rollout"]["uid"] = "u2", "u"
        recompute(src2, stale)
        assert set(src2.held) == {"web"} and store.pulls == []
        granted = paced(1, [OLD, NEW], granted=["n1"])
        granted["metadata"]["uid"], granted["status"]["rollout"]["uid"] = "u2", "u2"
        granted["metadata"]["resourceVersion"] = "99"
        recompute(src2, granted)
        await wait_for(lambda: NEW in store.pulls, what="NEW pulled once the new object grants it")
        await reconciled(h, "web", 2)
        row = NodeReport(src2, h.sets, None, interval=1, event_interval=60, event_namespace="default",
                         request_timeout=5).document()["status"]["sets"][0]
        assert (row["desiredGeneration"], row["uid"], row["currentGeneration"]) == ("1", "u2", "1")
        assert "currentUid" not in row and "reason" not in row
