"""Image sets from a real kube-apiserver: the shim as a process in front of real containerd,
its node identity and rights those of deploy/cluster/node-rbac.yaml (a node's ServiceAccount).

The Node objects are created through the API (no kubelet registers them here).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support import cri
from tests.support.apiserver import ControlPlane
from tests.support.kube import Admin
from tests.support.wait import wait_for_blocking as wait_for

SHIM = ("cri-shim.io", "v1")
MCO = "machineconfiguration.openshift.io"


def shim_config(cp: ControlPlane, tmp: Path, node: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "cluster": {"kubeconfig": str(cp.node_kubeconfig(tmp / f"{node}.kubeconfig", node)), "node_name": node,
                    "state_file": str(tmp / f"{node}-state.json"), "status_interval_seconds": 1,
                    "backoff_initial_seconds": 0.2, "backoff_max_seconds": 2, "watch_timeout_seconds": 30},
        "pulls": {"max_parallel": 2},
        "image_sets": {"max_parallel": 1},
    }
    for k, v in extra.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def image_set(name: str, refs: list[str], selector: dict[str, str], *, pin: bool = True) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": selector}, "pin": pin, "images": [{"name": r} for r in refs]}}


def pinned(shim: Any) -> dict[str, bool]:
    res = cri.call(shim.socket, "ListImages", cri.list_images_request(), timeout=30)
    return {i.id: i.pinned for i in cri.decode_list_images_response(res.unwrap())}


def node_status(admin: Admin, node: str) -> dict[str, Any]:
    obj = admin.get_custom(*SHIM, "nodeimagesetstatuses", node) or {}
    return obj.get("status") or {}


def set_row(admin: Admin, node: str, name: str) -> dict[str, Any] | None:
    return next((r for r in node_status(admin, node).get("sets", []) if r["name"] == name), None)


def current(admin: Admin, node: str, name: str) -> bool:
    row = set_row(admin, node, name)
    return bool(row) and row.get("currentGeneration") == row["desiredGeneration"]


def conditions(admin: Admin, node: str) -> dict[str, str]:
    return {c["type"]: c["status"] for c in node_status(admin, node).get("conditions", [])}


def delete(admin: Admin, group: str, version: str, plural: str, name: str) -> None:
    try:
        admin.custom("delete", group, version, plural, name)
    except ApiException as e:
        if e.status != 404:
            raise


def test_set_selecting_node_pulled_pinned_current_then_unselected(control_plane, admin, make_image, proxy,
                                                                    shim_factory, tmp_path) -> None:
    images = [make_image() for _ in range(3)]
    admin.set_node_labels("node-a", {"t1-gpu": "yes"})
    body = image_set("t1-warm", [i.ref for i in images], {"t1-gpu": "yes"})
    admin.apply_custom(*SHIM, "imagesets", body)
    try:
        shim = shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")
        wait_for(lambda: all(pinned(shim).get(i.image_id) for i in images), 60, "3 images pulled and pinned")
        stats = proxy.stats()
        assert {(i.repository, i.tag) for i in images} <= set(stats.manifests_by_image)
        assert all(stats.manifests_by_image[(i.repository, i.tag)] >= 1 for i in images)
        assert stats.max_concurrent_images == 1  # image_sets.max_parallel: 1 holds for the set's pulls
        wait_for(lambda: current(admin, "node-a", "t1-warm"), 30, "status: t1-warm current")
        st = node_status(admin, "node-a")
        row = set_row(admin, "node-a", "t1-warm")
        assert row is not None
        assert row["desiredGeneration"] == "1" and row["images"]["present"] == 3 and row["source"] == "cluster"
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Ready"]["status"] == "True" and conds["Degraded"]["status"] == "False"
        managers = {m["manager"] for m in admin.get_custom(*SHIM, "nodeimagesetstatuses", "node-a")
                    ["metadata"]["managedFields"]}
        assert managers == {"cri-shim"}
        # it goes with its Node: an owner reference to the Node (the garbage collector deletes it)
        node_uid = admin.run(lambda api: CoreV1Api(api).read_node("node-a")).metadata.uid
        owners = admin.get_custom(*SHIM, "nodeimagesetstatuses", "node-a")["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": node_uid}]
        out = subprocess.run([sys.executable, "-m", "shim", "fleet", "status", "--json", "--kubeconfig",
                              str(control_plane.dir / "admin.kubeconfig")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        fleet = json.loads(out.stdout)["t1-warm"]  # no controller runs here: the set's status says so
        assert fleet["generation"] == 1 and "controller" in fleet["note"]

        # the node's labels change: the set no longer selects it -> unpinned, status entry gone
        admin.set_node_labels("node-a", {"t1-gpu": None})
        wait_for(lambda: not any(pinned(shim).get(i.image_id) for i in images), 10, "3 images unpinned")
        assert all(i.image_id in pinned(shim) for i in images)  # unpinned, not removed
        wait_for(lambda: set_row(admin, "node-a", "t1-warm") is None, 15, "status entry removed")
    finally:
        delete(admin, *SHIM, "imagesets", "t1-warm")


def test_rbac_node_writes_only_its_own_status(control_plane, admin, tmp_path) -> None:
    """node-a's ServiceAccount may not write node-b's status object, nor read other Nodes or Secrets."""
    kc = Admin(control_plane.node_kubeconfig(tmp_path / "a.kubeconfig", "node-a"))
    body = {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": "node-b"},
            "status": {"nodeName": "node-b"}}
    with pytest.raises(ApiException) as e:
        kc.custom("patch", *SHIM, "nodeimagesetstatuses", "node-b", body, field_manager="cri-shim", force=True,
                  _content_type="application/apply-patch+yaml")
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        kc.run(lambda api: CoreV1Api(api).read_node("node-b"))
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        kc.run(lambda api: CoreV1Api(api).list_namespaced_secret("cri-shim"))
    assert e.value.status == 403
    assert kc.run(lambda api: CoreV1Api(api).read_node("node-a")).metadata.name == "node-a"
    kc.run(lambda api: CustomObjectsApi(api).list_cluster_custom_object(*SHIM, "imagesets"))


def shim_status(admin_sock: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket", admin_sock],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)["cluster"]


def _remove(shim: Any, image_id: str) -> cri.CallResult:
    return cri.call(shim.socket, "RemoveImage", cri.remove_image_request(image_id), timeout=30)


def test_api_server_down_pins_hold_and_restart_enforces_from_first_call(control_plane, admin, make_image,
                                                                         shim_factory, tmp_path, short_tmp) -> None:
    img = make_image()
    admin.set_node_labels("node-a", {"t2": "yes"})
    admin.apply_custom(*SHIM, "imagesets", image_set("t2-keep", [img.ref], {"t2": "yes"}))
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock})
    try:
        shim = shim_factory(cfg, log_level="info")
        wait_for(lambda: pinned(shim).get(img.image_id), 60, "image pinned")
        wait_for(lambda: current(admin, "node-a", "t2-keep"), 30, "status current")

        control_plane.stop_apiserver()
        time.sleep(1.5)  # the watches notice and back off; nothing may be dropped
        assert pinned(shim).get(img.image_id) is True
        res = _remove(shim, img.image_id)
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION, res

        # back: the same process resumes its watches (no re-list, or one after a 410) and reports again
        control_plane.start_apiserver()
        admin.set_node_labels("node-a", {"t2-touched": "1"})  # an event on each resumed watch
        touched = image_set("t2-keep", [img.ref], {"t2": "yes"})
        touched["metadata"]["annotations"] = {"touched": "1"}
        admin.apply_custom(*SHIM, "imagesets", touched)
        wait_for(lambda: not any(shim_status(admin_sock)["watches"][n].get("error") for n in ("node", "imagesets")),
                 60, "watches resumed", interval=0.5)
        lists = {name: w["lists"] for name, w in shim_status(admin_sock)["watches"].items()}
        print(f"\nlists per watched resource after an API server restart: {lists}")
        assert all(n <= 2 for n in lists.values()), lists
        assert current(admin, "node-a", "t2-keep")

        # restarted while the API server is down: the state file holds the pins from the first call
        control_plane.stop_apiserver()
        shim.stop()
        shim2 = shim_factory(cfg, log_level="info")
        res = _remove(shim2, img.image_id)
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION, res
        assert pinned(shim2).get(img.image_id) is True

        control_plane.start_apiserver()
        wait_for(lambda: shim_status(admin_sock)["status_object"]["writes"] >= 1
                 and all(w["synced"] for w in shim_status(admin_sock)["watches"].values()),
                 60, "the restarted shim's watches synced and its status written", interval=0.5)
        assert current(admin, "node-a", "t2-keep")
        assert pinned(shim2).get(img.image_id) is True
    finally:
        if control_plane.apiserver is None:
            control_plane.start_apiserver()
        delete(admin, *SHIM, "imagesets", "t2-keep")


def test_pinned_image_set_applies_through_its_pool_only(control_plane, admin, make_image, proxy, shim_factory,
                                                        tmp_path) -> None:
    worker_img, master_img = make_image(), make_image()
    admin.set_node_labels("node-a", {"t3-role": "worker"})
    admin.set_node_labels("node-b", {"t3-role": "master"})
    admin.apply_custom(MCO, "v1", "pinnedimagesets", {
        "apiVersion": f"{MCO}/v1", "kind": "PinnedImageSet", "metadata": {"name": "t3-worker-set"},
        "spec": {"pinnedImages": [{"name": worker_img.digest_ref}]}})
    admin.apply_custom(MCO, "v1alpha1", "pinnedimagesets", {  # written at v1alpha1, read at v1
        "apiVersion": f"{MCO}/v1alpha1", "kind": "PinnedImageSet", "metadata": {"name": "t3-master-set"},
        "spec": {"pinnedImages": [{"name": master_img.digest_ref}]}})
    for role in ("worker", "master"):
        admin.apply_custom(MCO, "v1", "machineconfigpools", {
            "apiVersion": f"{MCO}/v1", "kind": "MachineConfigPool", "metadata": {"name": f"t3-{role}"},
            "spec": {"nodeSelector": {"matchLabels": {"t3-role": role}},
                     "pinnedImageSets": [{"name": f"t3-{role}-set"}]}})
    try:
        shim_a = shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")
        wait_for(lambda: pinned(shim_a).get(worker_img.image_id), 60, "worker image pinned on node-a")
        wait_for(lambda: current(admin, "node-a", "t3-worker-set"), 30, "node-a status current")
        assert set_row(admin, "node-a", "t3-master-set") is None
        assert not any(repo == master_img.repository for repo, _ in proxy.stats().manifests_by_image)
        assert set_row(admin, "node-a", "t3-worker-set")["kind"] == "PinnedImageSet"

        shim_b = shim_factory(shim_config(control_plane, tmp_path, "node-b"), log_level="info")
        wait_for(lambda: pinned(shim_b).get(master_img.image_id), 60, "master image pinned on node-b")
        wait_for(lambda: current(admin, "node-b", "t3-master-set"), 30, "node-b status current")
        assert set_row(admin, "node-b", "t3-worker-set") is None
        assert not pinned(shim_b).get(worker_img.image_id)  # present (node-a pulled it) but not pinned here
    finally:
        for role in ("worker", "master"):
            delete(admin, MCO, "v1", "machineconfigpools", f"t3-{role}")
            delete(admin, MCO, "v1", "pinnedimagesets", f"t3-{role}-set")


def test_update_while_pulling_cancels_what_it_made_unnecessary(control_plane, admin, make_image, proxy,
                                                               shim_factory, tmp_path) -> None:
    keep, drop = make_image(), make_image()
    admin.set_node_labels("node-a", {"t4": "yes"})
    proxy.hold_blobs()  # both pulls start, then wait at their first blob
    admin.apply_custom(*SHIM, "imagesets", image_set("t4-edit", [keep.ref, drop.ref], {"t4": "yes"}))
    try:
        shim = shim_factory(shim_config(control_plane, tmp_path, "node-a", pulls={"max_parallel": 3},
                                        image_sets={"max_parallel": 2}),
                            log_level="info")
        wait_for(lambda: proxy.stats().inflight_images == 2, 60, "both pulls waiting for blobs")
        # slow is not failed: pulls that make no progress yet show Progressing, not Degraded
        wait_for(lambda: conditions(admin, "node-a").get("Progressing") == "True", 15, "Progressing")
        assert conditions(admin, "node-a")["Degraded"] == "False"
        admin.apply_custom(*SHIM, "imagesets", image_set("t4-edit", [keep.ref], {"t4": "yes"}))
        wait_for(lambda: "prefetch cancelled" in shim.log_text(), 10, "the dropped image's pull cancelled")
        proxy.release_blobs()
        wait_for(lambda: pinned(shim).get(keep.image_id), 60, "the kept image pulled and pinned")
        assert drop.image_id not in pinned(shim)
        wait_for(lambda: current(admin, "node-a", "t4-edit"), 30, "status current at generation 2")
        assert set_row(admin, "node-a", "t4-edit")["desiredGeneration"] == "2"
    finally:
        proxy.release_blobs()
        delete(admin, *SHIM, "imagesets", "t4-edit")


def test_failed_image_typed_in_status_and_event(control_plane, admin, make_image, registry, shim_factory,
                                                tmp_path) -> None:
    good = make_image()
    missing = f"{registry.host}/e2e/no-such-image-{time.monotonic_ns()}@sha256:{'4031' * 16}"  # 401, 403: notFound
    admin.set_node_labels("node-a", {"t7": "yes"})
    admin.apply_custom(*SHIM, "imagesets", image_set("t7-broken", [good.ref, missing], {"t7": "yes"}))
    try:
        shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")

        def degraded() -> dict[str, Any] | None:
            row = set_row(admin, "node-a", "t7-broken")
            return row if row and row.get("failedReasons") == {"notFound": 1} else None

        row = wait_for(degraded, 60, "the missing image counted as notFound", interval=0.5)
        assert row["images"]["present"] == 1 and row["images"]["failed"] == 1
        assert row["lastFailedGeneration"] == "1" and "currentGeneration" not in row
        assert "no-such-image" in row["error"]
        cond = {c["type"]: c for c in node_status(admin, "node-a")["conditions"]}
        assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "NotFound")
        events = wait_for(lambda: [e for e in admin.events() if e.reason == "ImageSetNotFound"  # of this set:
                                   and e.involved_object.name == "node-a" and "t7-broken" in e.message],  # node-a
                          30, "a Warning Event", interval=0.5)  # has others (test_cluster_many_sets.py)
        assert events[0].type == "Warning"
    finally:
        delete(admin, *SHIM, "imagesets", "t7-broken")


def test_pull_secret_by_reference(control_plane, admin, make_image, auth_registry, shim_factory, tmp_path) -> None:
    """A set naming a kubernetes.io/dockerconfigjson Secret (the one deploy/cluster/rbac.yaml lets nodes
    read): its image in a registry that requires auth is pulled with it; the node has no credentials."""
    from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER

    img = make_image(registry=auth_registry)
    auth = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    dockerconfig = json.dumps({"auths": {auth_registry.host: {"auth": auth}}})
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
              "metadata": {"name": "registry-pull", "namespace": "cri-shim"},
              "data": {".dockerconfigjson": base64.b64encode(dockerconfig.encode()).decode()}}
    admin.apply_docs([secret])
    admin.set_node_labels("node-a", {"t8": "yes"})
    body = image_set("t8-private", [img.ref], {"t8": "yes"})
    body["spec"]["imagePullSecrets"] = [{"namespace": "cri-shim", "name": "registry-pull"}]
    admin.apply_custom(*SHIM, "imagesets", body)
    try:
        shim = shim_factory(shim_config(control_plane, tmp_path, "node-a",
                                        image_sets={"docker_config": [str(tmp_path / "none.json")]}),
                            log_level="info")
        wait_for(lambda: pinned(shim).get(img.image_id), 60, "private image pulled with the Secret and pinned")
        assert AUTH_PASSWORD not in shim.log_text()
        assert AUTH_PASSWORD not in (tmp_path / "node-a-state.json").read_text()
    finally:
        delete(admin, *SHIM, "imagesets", "t8-private")
