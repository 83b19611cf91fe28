"""`cri-shim controller` and MCO's PinnedImageSets (test CRDs, tests/cluster/mco-crds.yaml) against
a real kube-apiserver: a set's nodes are those of the MachineConfigPools listing it, its truth
goes to a PinnedImageSetReport of ours (MCO owns the set's status). Simulated shims: the nodes'
NodeImageSetStatus rows of kind PinnedImageSet, as a shim writes them (test_cluster_sets.py
shows a real shim writing such a row), written by the test or by tests/support/sim_fleet.py's
nodes, which fetch the set's images from the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.cluster.test_cluster_sets import MCO, SHIM, delete, wait_for
from tests.cluster.test_controller import cleanup, report, table
from tests.support.kube import Admin
from tests.support.sim_fleet import SimFleet

KIND = "PinnedImageSet"
COLUMNS = ["Name", "Selected", "Current", "Progressing", "Failing", "Stale", "Age"]


def pis_report(admin: Admin, name: str) -> dict[str, Any]:
    return admin.get_custom(*SHIM, "pinnedimagesetreports", name) or {}


def counts(admin: Admin, name: str) -> tuple[int, ...]:
    st = pis_report(admin, name).get("status") or {}
    return tuple(st.get(k, -1) for k in ("selected", "current", "progressing", "failing", "stale", "missing"))


def pinned_set(name: str, *refs: str) -> dict[str, Any]:
    return {"apiVersion": f"{MCO}/v1", "kind": KIND, "metadata": {"name": name},
            "spec": {"pinnedImages": [{"name": r} for r in refs]}}


def pool(name: str, role: str, *sets: str) -> dict[str, Any]:
    return {"apiVersion": f"{MCO}/v1", "kind": "MachineConfigPool", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"p1-role": role}}, "pinnedImageSets": [{"name": s} for s in sets]}}


def test_pinned_image_set_truth_through_its_pools_in_a_report(control_plane, admin, controllers) -> None:
    nodes = {"p1-w1": "worker", "p1-w2": "worker", "p1-i1": "infra", "p1-x1": "other"}
    for n, role in nodes.items():
        admin.create_node(n, {"p1-role": role})
    admin.apply_custom(MCO, "v1", "pinnedimagesets", pinned_set("p1-warm", "reg.example/app:v1"))
    uid = (admin.get_custom(MCO, "v1", "pinnedimagesets", "p1-warm") or {})["metadata"]["uid"]
    admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p1-worker", "worker", "p1-warm"))
    admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p1-infra", "infra", "p1-warm"))
    admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p1-other", "other"))  # lists nothing
    try:
        report(admin, "p1-w1", "p1-warm", "1", "1", kind=KIND)
        report(admin, "p1-w2", "p1-warm", "1", None, kind=KIND, images={"declared": 1, "failed": 1},
               failedReasons={"notFound": 1}, error="reg.example/app:v1: NOT_FOUND")
        report(admin, "p1-x1", "p1-warm", "1", "1", kind=KIND)  # not selected: its pool does not list the set
        ctl = controllers("p1-a")
        # p1-i1 (infra pool) has no report at all: missing
        wait_for(lambda: counts(admin, "p1-warm") == (3, 1, 0, 1, 0, 1), 30, "selected 3, current 1, failing 1, "
                 "missing 1")
        obj = pis_report(admin, "p1-warm")
        st = obj["status"]
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": f"{MCO}/v1", "kind": KIND, "name": "p1-warm",
                                                       "uid": uid}]
        assert {m["manager"] for m in obj["metadata"]["managedFields"]} == {"cri-shim-controller"}
        assert st["machineConfigPools"] == ["p1-infra", "p1-worker"] and st["observedGeneration"] == 1
        assert st["missingNodes"] == ["p1-i1"] and st["failedReasons"] == {"notFound": 1}
        assert st["failingNodes"] == [{"node": "p1-w2", "reasons": "notFound", "error": "reg.example/app:v1: NOT_FOUND"}]
        assert {c["type"]: f"{c['status']}/{c['reason']}" for c in st["conditions"]} == {
            "Available": "False/NodesNotCurrent", "Progressing": "False/Idle", "Degraded": "True/NotFound",
            "DiskPressure": "False/BelowThreshold"}
        assert "rollout" not in st  # not paced: MCO owns the set
        assert (admin.get_custom(MCO, "v1", "pinnedimagesets", "p1-warm") or {}).get("status") is None  # untouched

        # `kubectl get pinnedimagesetreports`: the columns and this set's row
        t = table(control_plane, "pinnedimagesetreports")
        names = [c["name"] for c in t["columnDefinitions"] if c.get("priority", 0) == 0]
        assert names == COLUMNS, names
        row = next(r["cells"] for r in t["rows"] if r["cells"][0] == "p1-warm")
        assert row[1:6] == [3, 1, 0, 1, 0], row

        # the failing node catches up; the "other" pool starts listing the set: p1-x1 counts, current
        report(admin, "p1-w2", "p1-warm", "1", "1", kind=KIND)
        admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p1-other", "other", "p1-warm"))
        wait_for(lambda: counts(admin, "p1-warm") == (4, 3, 0, 0, 0, 1), 30, "selected 4, current 3, missing 1")
        # the infra pool stops listing it, and the set moves to generation 2: behind nodes progress
        admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p1-infra", "infra"))
        admin.apply_custom(MCO, "v1", "pinnedimagesets", pinned_set("p1-warm", "reg.example/app:v2"))
        def behind() -> bool:  # progressing, or stale once --stale-after passes (4 s here)
            c = counts(admin, "p1-warm")
            gen = (pis_report(admin, "p1-warm").get("status") or {}).get("observedGeneration")
            return gen == 2 and c[:2] == (3, 0) and c[2] + c[4] == 3 and c[3] == c[5] == 0
        wait_for(behind, 30, "generation 2: 3 nodes behind")
        for n in ("p1-w1", "p1-w2", "p1-x1"):
            report(admin, n, "p1-warm", "2", "2", kind=KIND)
        wait_for(lambda: counts(admin, "p1-warm") == (3, 3, 0, 0, 0, 0), 30, "generation 2 current everywhere")
        st = pis_report(admin, "p1-warm")["status"]
        assert st["observedGeneration"] == 2 and st["machineConfigPools"] == ["p1-other", "p1-worker"]
        assert {c["type"]: c["status"] for c in st["conditions"]}["Available"] == "True"
        assert st["rolloutCompletionTime"] >= st["rolloutStartTime"]

        # a relabelled Node leaves the set
        admin.set_node_labels("p1-x1", {"p1-role": "gone"})
        wait_for(lambda: counts(admin, "p1-warm") == (2, 2, 0, 0, 0, 0), 30, "p1-x1 relabelled away")

        out = subprocess.run([sys.executable, "-m", "shim", "fleet", "status", "--json", "--kubeconfig",
                              str(control_plane.dir / "admin.kubeconfig")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        fleet = json.loads(out.stdout)["PinnedImageSet/p1-warm"]
        assert (fleet["selected"], fleet["current"], fleet["generation"]) == (2, 2, 2)
        assert fleet["machineConfigPools"] == ["p1-other", "p1-worker"]
        text = subprocess.run([sys.executable, "-m", "shim", "fleet", "status", "--kubeconfig",
                               str(control_plane.dir / "admin.kubeconfig")], capture_output=True, text=True, timeout=60)
        assert "PinnedImageSet/p1-warm" in text.stdout and "pools: p1-other, p1-worker" in text.stdout, text.stdout
        assert "cannot write" not in ctl.log_text(), ctl.log_text()
        assert "MCO's PinnedImageSets are served" in ctl.log_text()
    finally:
        for p in ("p1-worker", "p1-infra", "p1-other"):
            delete(admin, MCO, "v1", "machineconfigpools", p)
        delete(admin, MCO, "v1", "pinnedimagesets", "p1-warm")
        delete(admin, *SHIM, "pinnedimagesetreports", "p1-warm")  # no garbage collector in this cluster
        cleanup(admin, "p1-warm", list(nodes))  # the Nodes, their status objects (and no ImageSet of that name)


def test_pinned_image_set_pulled_by_simulated_shims_through_a_pool(control_plane, admin, controllers, registry,
                                                                   make_image) -> None:
    """Simulated shims (tests/support/sim_fleet.py) on the nodes a pool selects really fetch the
    set's images from the registry; the report follows them: a node without a shim is missing, a
    missing image makes every node fail with its reason, pushing it makes them current."""
    sims = ["p2-n1", "p2-n2", "p2-n3"]
    for n in [*sims, "p2-n4"]:  # p2-n4: selected, no shim
        admin.create_node(n, {"p1-role": "p2-worker"})
    present = make_image()
    missing = f"{registry.host}/p2/not-pushed-yet:v1"
    admin.apply_custom(MCO, "v1", "pinnedimagesets", pinned_set("p2-warm", present.ref))
    admin.apply_custom(MCO, "v1", "machineconfigpools", pool("p2-worker", "p2-worker", "p2-warm"))
    fleet = SimFleet(control_plane.dir / "admin.kubeconfig", registry.direct_host, "p2-warm", sims,
                     retry_seconds=0.5, kind=KIND).start()
    try:
        controllers("p2-a")
        wait_for(lambda: counts(admin, "p2-warm") == (4, 3, 0, 0, 0, 1), 60, "3 current, p2-n4 missing")
        assert all(fleet.requests(n) >= 1 for n in sims)  # each fetched from the registry

        admin.apply_custom(MCO, "v1", "pinnedimagesets", pinned_set("p2-warm", present.ref, missing))
        wait_for(lambda: counts(admin, "p2-warm")[3] == 3, 60, "generation 2: 3 nodes failing")
        st = pis_report(admin, "p2-warm")["status"]
        assert st["observedGeneration"] == 2 and st["failedReasons"] == {"notFound": 3}
        assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "NotFound"
        row = next(r["cells"] for r in table(control_plane, "pinnedimagesetreports")["rows"] if r["cells"][0] == "p2-warm")
        print(f"\nkubectl get pinnedimagesetreports (failing): {row}")
        assert row[1:6] == [4, 0, 0, 3, 0], row

        make_image(name="p2/not-pushed-yet", tag="v1")
        wait_for(lambda: counts(admin, "p2-warm") == (4, 3, 0, 0, 0, 1), 60, "generation 2 current on the 3")
        st = pis_report(admin, "p2-warm")["status"]
        assert st["observedGeneration"] == 2 and st["missingNodes"] == ["p2-n4"], st
        assert not fleet.errors, fleet.errors
    finally:
        fleet.stop()
        delete(admin, MCO, "v1", "machineconfigpools", "p2-worker")
        delete(admin, MCO, "v1", "pinnedimagesets", "p2-warm")
        delete(admin, *SHIM, "pinnedimagesetreports", "p2-warm")
        cleanup(admin, "p2-warm", [*sims, "p2-n4"])
