"""A declaration that cannot be applied never unpins: against a real kube-apiserver and containerd.

* The API server refuses an ImageSet naming an image the shim would refuse (the CRD's pattern and
  CEL rules), with the rule's message, and agrees with the shim on a corpus of names (up to the
  CRD's maxLength).
* When such an edit reaches the node anyway (an ImageSet CRD older than the shim: its rules taken
  out here; MCO's PinnedImageSet, whose CRD is not ours), the set's last valid version stays:
  pinned, present, RemoveImage refused, across a restart; the set's row says why.
* A pull Secret a set names that cannot be read keeps the set, and is reported.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import Any, Iterator

import grpc
import yaml
from kubernetes_asyncio.client import ApiextensionsV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from tests.cluster.test_cluster_sets import (
    MCO,
    SHIM,
    _remove,
    conditions,
    current,
    delete,
    image_set,
    node_status,
    pinned,
    set_row,
    shim_config,
    wait_for,
)
from tests.support.kube import REPO, Admin
from tests.unit.test_crd_reference_rules import CORPUS, shim_accepts

CRD = "imagesets.cri-shim.io"
LOWER_CASE_RULE = "the repository path must be lower case"


def _dry_run(admin: Admin, name: str, images: list[str]) -> ApiException | None:
    body = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"images": [{"name": i} for i in images]}}
    try:
        admin.custom("create", *SHIM, "imagesets", body, dry_run="All")
    except ApiException as e:
        return e
    return None


def _name_schema(crd: dict[str, Any]) -> dict[str, Any]:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["images"]["items"]["properties"]["name"]  # type: ignore[no-any-return]


def _replace_crd(admin: Admin, edit: Any) -> None:
    async def go(api: Any) -> None:
        ext = ApiextensionsV1Api(api)
        crd = api.sanitize_for_serialization(await ext.read_custom_resource_definition(CRD))
        edit(crd)
        await ext.replace_custom_resource_definition(CRD, crd)
    admin.run(go)


@contextlib.contextmanager
def older_crd(admin: Admin) -> Iterator[None]:
    """The ImageSet CRD without its name checks (as one applied before them), restored afterwards."""
    shipped = next(d for d in yaml.safe_load_all((REPO / "deploy" / "cluster" / "crds.yaml").read_text())
                   if d["metadata"]["name"] == CRD)
    bad = ["reg.example.com/Team/App:v1"]
    def older(crd: dict[str, Any]) -> None:
        name = _name_schema(crd)
        name.pop("x-kubernetes-validations", None)
        name.pop("pattern", None)
        name["maxLength"] = 1024
    _replace_crd(admin, older)
    try:
        wait_for(lambda: _dry_run(admin, "t-older-crd", bad) is None, 30, "the rules out of force", interval=0.2)
        yield
    finally:
        def restore(crd: dict[str, Any]) -> None:
            for key in ("x-kubernetes-validations", "pattern", "maxLength"):
                _name_schema(crd)[key] = _name_schema(shipped)[key]
        _replace_crd(admin, restore)
        wait_for(lambda: _dry_run(admin, "t-older-crd", bad) is not None, 30, "the rules back", interval=0.2)


def test_api_server_refuses_what_the_shim_refuses_with_the_rules_message(control_plane, admin) -> None:
    err = _dry_run(admin, "t-cel", ["host:5000/Team/App:v1"])
    assert err is not None and err.status == 422
    body = json.loads(err.body)
    print(f"\n422 from the API server: {body['message']}")
    assert LOWER_CASE_RULE in body["message"] and "spec.images[0].name" in body["message"]
    err = _dry_run(admin, "t-cel", ["a" * 240])  # docker.io/library/ + 240 > 255
    assert err is not None and err.status == 422 and "longer than 255 characters" in err.body
    err = _dry_run(admin, "t-cel", ["registry.local/" + "a" * 280 + ":v1"])
    assert err is not None and err.status == 422  # longer than the CRD's maxLength

    disagree = [n for n in CORPUS if (_dry_run(admin, "t-cel", [n]) is None) != shim_accepts(n)]
    assert disagree == []
    print(f"API server and shim agree on all {len(CORPUS)} names of the corpus")

    # the rules fit the API server's runtime CEL budget for a full-size set of long names
    shipped = yaml.safe_load((REPO / "deploy" / "cluster" / "crds.yaml").read_text().split("\n---\n")[0])
    max_items = shipped["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "images"]["maxItems"]
    refs = [f"registry.example.com:5000/team-{i % 97}/application-{i}/component:v1.2.3@sha256:{i:064x}"
            for i in range(max_items)]
    assert _dry_run(admin, "t-cel-big", refs) is None, f"{max_items} names of {len(refs[-1])} characters"


def _status_text(admin_sock: str) -> str:
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--admin-socket", admin_sock],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _fleet(control_plane: Any) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "shim", "fleet", "status", "--json", "--kubeconfig",
                          str(control_plane.dir / "admin.kubeconfig")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _refused(admin: Admin, node: str, name: str, generation: str) -> dict[str, Any] | None:
    row = set_row(admin, node, name)
    return row if row and row.get("reason") == "InvalidSet" and row.get("lastFailedGeneration") == generation else None


def _kept(shim: Any, images: list[Any]) -> None:
    """Every image pinned and present, and RemoveImage of one refused."""
    now = pinned(shim)
    assert all(now.get(i.image_id) is True for i in images), now
    res = _remove(shim, images[0].image_id)
    assert res.code is grpc.StatusCode.FAILED_PRECONDITION, res
    assert images[0].image_id in pinned(shim)


def test_bad_imageset_edit_keeps_the_last_valid_version(control_plane, admin, make_image, registry, shim_factory,
                                                        tmp_path, short_tmp, controllers) -> None:
    images = [make_image() for _ in range(3)]
    admin.set_node_labels("node-a", {"t9": "yes"})
    admin.apply_custom(*SHIM, "imagesets", image_set("t9-keep", [i.ref for i in images], {"t9": "yes"}))
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock})
    try:
        shim = shim_factory(cfg, log_level="info")
        wait_for(lambda: all(pinned(shim).get(i.image_id) for i in images), 60, "3 images pulled and pinned")
        wait_for(lambda: current(admin, "node-a", "t9-keep"), 30, "status current at generation 1")

        upper = f"{registry.host}/Team/App:v1"
        with older_crd(admin):
            admin.apply_custom(*SHIM, "imagesets", image_set("t9-keep", [*(i.ref for i in images), upper],
                                                             {"t9": "yes"}))
            row = wait_for(lambda: _refused(admin, "node-a", "t9-keep", "2"), 30, "the set's row: generation 2 "
                           "refused", interval=0.3)
            print(f"\nrow of the refused set: {row}")
            assert (row["currentGeneration"], row["desiredGeneration"]) == ("1", "2")
            assert "spec.images[3].name" in row["error"] and "Team/App" in row["error"] and "lowercase" in row["error"]
            assert row["images"]["present"] == 3
            conds = {c["type"]: c for c in node_status(admin, "node-a")["conditions"]}
            assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "InvalidSet")
            assert conds["Ready"]["status"] == "False"
            _kept(shim, images)
            events = wait_for(lambda: [e for e in admin.events() if e.reason == "ImageSetInvalid"
                                       and "t9-keep" in e.message], 30, "a Warning Event", interval=0.5)
            assert events[0].type == "Warning" and "generation 1 stays in force" in events[0].message
            text = _status_text(admin_sock)
            assert "refused" in text and "set t9-keep generation 2" in text and "in force: generation 1" in text
            controllers("t9-controller")  # the fleet view is what the controller writes on the set
            fleet = wait_for(lambda: _fleet(control_plane)["t9-keep"].get("failing") == 1
                             and _fleet(control_plane)["t9-keep"], 30, "the set's status: 1 failing")
            assert fleet["failingNodes"][0]["node"] == "node-a"
            assert "InvalidSet" in fleet["failingNodes"][0]["reasons"]
            state = json.loads((tmp_path / "node-a-state.json").read_text())
            assert [(o["metadata"]["name"], o["metadata"]["generation"]) for o in state["imageSets"]] == [
                ("t9-keep", 1)]

            # a 300-character name: the same
            long_name = f"{registry.host}/" + "a" * 290 + ":v1"
            admin.apply_custom(*SHIM, "imagesets", image_set("t9-keep", [*(i.ref for i in images), long_name],
                                                             {"t9": "yes"}))
            row = wait_for(lambda: _refused(admin, "node-a", "t9-keep", "3"), 30, "generation 3 refused",
                           interval=0.3)
            assert row["currentGeneration"] == "1" and "longer than 255" in row["error"]
            _kept(shim, images)

            # a restart with the API server up: pinned from the first call, still refused, still reported
            shim.stop()
            shim = shim_factory(cfg, log_level="info")
            _kept(shim, images)
            wait_for(lambda: "cluster image set refused; its last valid version stays in force" in shim.log_text(),
                     30, "refused again after the restart")
            _kept(shim, images)
            assert set_row(admin, "node-a", "t9-keep")["currentGeneration"] == "1"

        # fixed: generation 4 applies, nothing refused
        admin.apply_custom(*SHIM, "imagesets", image_set("t9-keep", [i.ref for i in images], {"t9": "yes"}))
        wait_for(lambda: current(admin, "node-a", "t9-keep"), 30, "status current at generation 4")
        row = set_row(admin, "node-a", "t9-keep")
        assert row["currentGeneration"] == "4" and "reason" not in row and row["lastFailedGeneration"] == "3"
        wait_for(lambda: conditions(admin, "node-a").get("Degraded") == "False", 30, "Degraded False")
    finally:
        delete(admin, *SHIM, "imagesets", "t9-keep")


def test_bad_pinned_image_set_edit_keeps_the_last_valid_version(control_plane, admin, make_image, registry,
                                                                shim_factory, tmp_path) -> None:
    images = [make_image() for _ in range(3)]
    admin.set_node_labels("node-a", {"t10-role": "worker"})

    def pis(names: list[str]) -> dict[str, Any]:
        return {"apiVersion": f"{MCO}/v1", "kind": "PinnedImageSet", "metadata": {"name": "t10-set"},
                "spec": {"pinnedImages": [{"name": n} for n in names]}}

    admin.apply_custom(MCO, "v1", "pinnedimagesets", pis([i.digest_ref for i in images]))
    admin.apply_custom(MCO, "v1", "machineconfigpools", {
        "apiVersion": f"{MCO}/v1", "kind": "MachineConfigPool", "metadata": {"name": "t10-worker"},
        "spec": {"nodeSelector": {"matchLabels": {"t10-role": "worker"}}, "pinnedImageSets": [{"name": "t10-set"}]}})
    try:
        shim = shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")
        wait_for(lambda: all(pinned(shim).get(i.image_id) for i in images), 60, "3 images pulled and pinned")
        wait_for(lambda: current(admin, "node-a", "t10-set"), 30, "status current")
        # MCO's CRD is not ours: the API server takes the name, the node refuses it
        admin.apply_custom(MCO, "v1", "pinnedimagesets", pis([*(i.digest_ref for i in images),
                                                              f"{registry.host}/Team/App:v1"]))
        row = wait_for(lambda: _refused(admin, "node-a", "t10-set", "2"), 30, "generation 2 refused", interval=0.3)
        assert row["kind"] == "PinnedImageSet" and row["currentGeneration"] == "1"
        assert "spec.pinnedImages[3].name" in row["error"] and "lowercase" in row["error"]
        conds = {c["type"]: c for c in node_status(admin, "node-a")["conditions"]}
        assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "InvalidSet")
        _kept(shim, images)
        state = json.loads((tmp_path / "node-a-state.json").read_text())
        assert [o["metadata"]["generation"] for o in state["pinnedImageSets"]] == [1]
    finally:
        delete(admin, MCO, "v1", "machineconfigpools", "t10-worker")
        delete(admin, MCO, "v1", "pinnedimagesets", "t10-set")


def test_unreadable_pull_secret_keeps_the_set_and_is_reported(control_plane, admin, make_image, shim_factory,
                                                              tmp_path) -> None:
    images = [make_image() for _ in range(2)]
    admin.set_node_labels("node-a", {"t11": "yes"})
    body = image_set("t11-secret", [i.ref for i in images], {"t11": "yes"})
    body["spec"]["imagePullSecrets"] = [{"namespace": "cri-shim", "name": "t11-not-there"}]
    admin.apply_custom(*SHIM, "imagesets", body)
    try:
        shim = shim_factory(shim_config(control_plane, tmp_path, "node-a"), log_level="info")
        wait_for(lambda: all(pinned(shim).get(i.image_id) for i in images), 60, "pulled anonymously and pinned")

        def reported() -> dict[str, Any] | None:
            row = set_row(admin, "node-a", "t11-secret")
            return row if row and row.get("reason") == "PullSecretUnavailable" else None

        row = wait_for(reported, 30, "the Secret reported in the set's row", interval=0.3)
        assert "Secret cri-shim/t11-not-there" in row["error"]
        conds = {c["type"]: c for c in node_status(admin, "node-a")["conditions"]}
        assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "PullSecretUnavailable")
        _kept(shim, images)
    finally:
        delete(admin, *SHIM, "imagesets", "t11-secret")
