"""`cri-shim controller` against a real kube-apiserver, as processes with the rights of
deploy/cluster/controller.yaml. Simulated shims: NodeImageSetStatus objects the test writes
with the shims' field manager (``cri-shim``), as shim/cluster/node_report.py does."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from typing import Any

import yaml
from kubernetes_asyncio.client import AppsV1Api, CoordinationV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from tests.cluster.test_cluster_sets import SHIM, delete, wait_for
from tests.support.apiserver import ControlPlane
from tests.support.controller import STALE_AFTER
from tests.support.kube import DEPLOY, Admin
from tests.support.procs import kill

COLUMNS = ["Name", "Selected", "Current", "Progressing", "Waiting", "Failing", "Stale", "Rollout", "Age"]


def set_status(admin: Admin, name: str) -> dict[str, Any]:
    return (admin.get_custom(*SHIM, "imagesets", name) or {}).get("status") or {}


def counts(admin: Admin, name: str) -> tuple[int, ...]:
    st = set_status(admin, name)
    return tuple(st.get(k, -1) for k in ("selected", "current", "progressing", "failing", "stale", "missing"))


def conds(admin: Admin, name: str) -> dict[str, str]:
    return {c["type"]: f"{c['status']}/{c['reason']}" for c in set_status(admin, name).get("conditions", [])}


def report(admin: Admin, node: str, name: str, desired: str, current: str | None, kind: str = "ImageSet",
           **row: Any) -> None:
    """A simulated shim: the node's NodeImageSetStatus with one row, as node_report.py writes it."""
    r = {"name": name, "kind": kind, "source": "cluster", "desiredGeneration": desired, **row}
    if current is not None:
        r["currentGeneration"] = current
    body = {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": node},
            "status": {"nodeName": node, "sets": [r]}}
    admin.custom("patch", *SHIM, "nodeimagesetstatuses", node, body, field_manager="cri-shim", force=True,
                 _content_type="application/apply-patch+yaml")


def table(cp: ControlPlane, plural: str = "imagesets") -> dict[str, Any]:
    """What `kubectl get imagesets` (or another of ours) prints: the API server's Table rendering."""
    req = urllib.request.Request(f"{cp.url}/apis/cri-shim.io/v1/{plural}", headers={
        "Authorization": f"Bearer {cp.admin_token}", "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=str(cp.ca)), timeout=30) as r:
        return json.loads(r.read())


def _set(name: str, refs: list[str], selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": selector}, "images": [{"name": r} for r in refs]}}


def test_set_truth_missing_stale_deleted_and_columns(control_plane, admin, controllers) -> None:
    nodes = ("c1-n1", "c1-n2", "c1-n3")
    for n in nodes:
        admin.create_node(n, {"c1-pool": "gpu"})
    admin.apply_custom(*SHIM, "imagesets", _set("c1-warm", ["reg.example/app:v1"], {"c1-pool": "gpu"}))
    try:
        report(admin, "c1-n1", "c1-warm", "1", "1")
        report(admin, "c1-n2", "c1-warm", "1", "1")
        ctl = controllers("c1-a")
        # a selected node without any report: missing, not invisible
        wait_for(lambda: counts(admin, "c1-warm") == (3, 2, 0, 0, 0, 1), 30, "selected 3, current 2, missing 1")
        st = set_status(admin, "c1-warm")
        assert st["missingNodes"] == ["c1-n3"] and st["observedGeneration"] == 1
        assert conds(admin, "c1-warm") == {"Available": "False/NodesNotCurrent", "Progressing": "False/Idle",
                                           "Degraded": "True/NodesMissing",
                                           "DiskPressure": "False/BelowThreshold"}
        obj = admin.get_custom(*SHIM, "imagesets", "c1-warm")
        managers = {(m["manager"], m.get("subresource", "")) for m in obj["metadata"]["managedFields"]}
        assert ("cri-shim-controller", "status") in managers

        # `kubectl get imagesets`: the columns and this set's row
        t = table(control_plane)
        names = [c["name"] for c in t["columnDefinitions"] if c.get("priority", 0) == 0]
        assert names == COLUMNS, names
        row = next(r["cells"] for r in t["rows"] if r["cells"][0] == "c1-warm")
        assert row[1:8] == [3, 2, 0, None, 0, 0, None], row  # not paced: no Waiting, no Rollout

        # the set moves to generation 2; n1 catches up, n2's shim stops at 1 and says nothing
        changed = time.time()  # before the change: the controller sees it later
        admin.apply_custom(*SHIM, "imagesets", _set("c1-warm", ["reg.example/app:v2"], {"c1-pool": "gpu"}))
        report(admin, "c1-n1", "c1-warm", "2", "2")
        wait_for(lambda: counts(admin, "c1-warm") == (3, 1, 1, 0, 0, 1), 30, "n2 progressing (within its age)")
        assert set_status(admin, "c1-warm")["observedGeneration"] == 2
        # nothing else happens: the due time, not an event, turns it stale
        wait_for(lambda: counts(admin, "c1-warm") == (3, 1, 0, 0, 1, 1), STALE_AFTER + 10, "n2 stale")
        took = time.time() - changed
        print(f"\nn2 counted stale {took:.1f} s after the generation change (--stale-after {STALE_AFTER})")
        assert took >= STALE_AFTER
        assert set_status(admin, "c1-warm")["staleNodes"] == ["c1-n2"]
        assert conds(admin, "c1-warm")["Degraded"] == "True/NodesStale"

        # a failure on n1 at generation 2: failing, by typed reason
        report(admin, "c1-n1", "c1-warm", "2", "1", images={"declared": 1, "failed": 1},
               failedReasons={"notFound": 1}, error="reg.example/app:v2: NOT_FOUND")
        wait_for(lambda: counts(admin, "c1-warm")[3] == 1, 30, "n1 failing")
        st = set_status(admin, "c1-warm")
        assert st["failedReasons"] == {"notFound": 1}
        assert st["failingNodes"] == [{"node": "c1-n1", "reasons": "notFound", "error": "reg.example/app:v2: NOT_FOUND"}]
        assert conds(admin, "c1-warm")["Degraded"] == "True/NotFound"
        report(admin, "c1-n1", "c1-warm", "2", "2")

        # deleted Nodes are gone from the counts, their status objects' rows with them
        for n in ("c1-n2", "c1-n3"):
            admin.run(lambda api, n=n: CoreV1Api(api).delete_node(n))
        wait_for(lambda: counts(admin, "c1-warm") == (1, 1, 0, 0, 0, 0), 30, "selected 1, current 1")
        assert admin.get_custom(*SHIM, "nodeimagesetstatuses", "c1-n2") is not None  # no GC here: still not counted
        st = set_status(admin, "c1-warm")
        assert conds(admin, "c1-warm") == {"Available": "True/AllNodesCurrent", "Progressing": "False/Idle",
                                           "Degraded": "False/NoFailures",
                                           "DiskPressure": "False/BelowThreshold"}
        assert st["rolloutSeconds"] >= STALE_AFTER and st["rolloutCompletionTime"] >= st["rolloutStartTime"]
        print(f"rollout of generation 2: {st['rolloutSeconds']} s")

        out = subprocess.run([sys.executable, "-m", "shim", "fleet", "status", "--json", "--kubeconfig",
                              str(control_plane.dir / "admin.kubeconfig")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        fleet = json.loads(out.stdout)["c1-warm"]
        assert (fleet["selected"], fleet["current"], fleet["generation"]) == (1, 1, 2) and "note" not in fleet
        writes = ctl.log_text().count("cannot write")
        assert writes == 0, ctl.log_text()
    finally:
        cleanup(admin, "c1-warm", nodes)


def cleanup(admin: Admin, name: str, nodes: tuple[str, ...] | list[str]) -> None:
    """Delete the set, the Nodes and their status objects."""
    delete(admin, *SHIM, "imagesets", name)
    for n in nodes:
        try:
            admin.run(lambda api, n=n: CoreV1Api(api).delete_node(n))
        except ApiException as e:
            if e.status != 404:
                raise
        delete(admin, *SHIM, "nodeimagesetstatuses", n)


def _lease(admin: Admin) -> Any:
    try:
        return admin.run(lambda api: CoordinationV1Api(api).read_namespaced_lease("cri-shim-controller", "cri-shim"))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _holder(admin: Admin) -> str:
    lease = _lease(admin)
    return str(lease.spec.holder_identity or "") if lease is not None else ""


LEASE = 15.0  # client-go's timings, the controller's defaults: lease 15 s, renew deadline 10 s, retry 2 s
# kill -> the new leader's first write: the lease duration after the killed leader's last renewal
# (at most the kill itself), plus the round-trips no rule can avoid: the watch event of that
# renewal, the standby's read and write of the Lease, and its first status write
ROUND_TRIPS = 1.0


def test_leader_killed_standby_takes_over_within_the_lease(control_plane, admin, controllers) -> None:
    admin.create_node("c2-n1", {"c2-pool": "x"})
    admin.apply_custom(*SHIM, "imagesets", _set("c2-set", ["reg.example/app:v1"], {"c2-pool": "x"}))
    try:
        a, b = controllers("c2-a"), controllers("c2-b")
        leader_id = wait_for(lambda: _holder(admin) in ("c2-a", "c2-b") and _holder(admin), 30, "a leader")
        wait_for(lambda: counts(admin, "c2-set") == (1, 0, 0, 0, 0, 1), 30, "the leader's first status")
        leader, standby = (a, b) if leader_id == "c2-a" else (b, a)
        time.sleep(3)  # the standby has seen the Lease renewed
        assert _holder(admin) == leader_id and "became leader" not in standby.log_text()

        kill(leader.proc)  # SIGKILL: no release
        killed = time.monotonic()
        report(admin, "c2-n1", "c2-set", "1", "1")  # a change only a live leader writes into the set's status
        seen: dict[str, Any] = {}

        def acted() -> bool:
            lease = _lease(admin)
            if lease.spec.holder_identity == leader_id:
                seen["renewed"] = lease.spec.renew_time  # the killed leader's last renewal (an in-flight one too)
            elif "holder" not in seen:
                seen["holder"], seen["acquired"] = time.monotonic() - killed, lease.spec.acquire_time
            if "wrote" not in seen and counts(admin, "c2-set") == (1, 1, 0, 0, 0, 0):
                seen["wrote"] = time.monotonic() - killed
            return "holder" in seen and "wrote" in seen  # the write may come between two looks at the Lease
        wait_for(acted, 25, "the new leader's status", interval=0.05)
        took = seen["wrote"]
        gap = (seen["acquired"] - seen["renewed"]).total_seconds()
        print(f"\nleader killed: the standby held the Lease after {seen['holder']:.2f} s and wrote the set's status "
              f"after {took:.2f} s; it took the Lease {gap:.2f} s after the last renewal (lease {LEASE:.0f} s)")
        assert _holder(admin) == standby.identity and "became leader" in standby.log_text()
        assert "resource=leader-lease" not in standby.log_text()  # its Role lets it watch the Lease: no error
        assert gap >= LEASE  # never before the lease duration since the last renewal (one host: one wall clock)
        # the rollout goes on within the lease duration of the kill (plus the round-trips above)
        assert took <= LEASE + ROUND_TRIPS, took

        # a leader stopped with SIGTERM releases the Lease: the standby sees it on its watch and takes it
        c = controllers("c2-c")
        time.sleep(3)
        standby.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        wait_for(lambda: _holder(admin) == "c2-c", 10, "c2-c holds the Lease", interval=0.05)
        took = time.monotonic() - stopped
        print(f"leader stopped (SIGTERM); the next took the Lease after {took:.2f} s")
        assert "released the leader Lease" in standby.log_text()
        assert took < 2 * ROUND_TRIPS + 1, took  # the stopping process's exit, its release, the watch, one try
        assert "became leader" in c.log_text()
    finally:
        delete(admin, *SHIM, "imagesets", "c2-set")
        delete(admin, *SHIM, "nodeimagesetstatuses", "c2-n1")
        admin.run(lambda api: CoreV1Api(api).delete_node("c2-n1"))


def test_deployment_manifest_accepted(control_plane, admin) -> None:
    """deploy/cluster/controller.yaml's Deployment is valid for the API server (a dry run; test_controller_pods.py runs it as pods)."""
    dep = next(d for d in yaml.safe_load_all((DEPLOY / "controller.yaml").read_text()) if d and d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    out = admin.run(lambda api: AppsV1Api(api).create_namespaced_deployment("cri-shim", dep, dry_run="All"))
    assert out.spec.template.spec.service_account_name == "cri-shim-controller"
