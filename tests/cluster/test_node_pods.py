"""The priority of the pods bound to a node, read with the node's own identity (kubelet's
kubeconfig, user system:node:<name>) from a real kube-apiserver (--authorization-mode Node,RBAC):
the Priority admission plugin sets ``spec.priority`` from ``priorityClassName``, the Node
authorizer lets the node list and watch the pods bound to it and no others (shim/cluster/pods.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import new_client_from_config

from shim.cluster.client import new_client
from shim.cluster.pods import NodePods
from shim.cluster.reachability import Reachability
from tests.support.apiserver import ControlPlane
from tests.support.kube import Admin
from tests.support.wait import wait_for

from .test_cluster_sets import shim_config, shim_status
from .test_cluster_sets import wait_for as wait_for_blocking

NS = "kube-system"
SYSTEM_NODE_CRITICAL = 2000001000  # the built-in PriorityClass's value


def pod(name: str, node: str, priority_class: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "automountServiceAccountToken": False,
                            "containers": [{"name": "c", "image": "registry.example/app:1"}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def create_pods(admin: Admin, *pods: dict[str, Any]) -> dict[str, Any]:
    """name -> the stored pod (its uid, its spec.priority as admission set it)."""
    async def go(api: Any) -> dict[str, Any]:
        core = CoreV1Api(api)
        try:  # the ServiceAccount admission plugin needs it; no controller-manager makes it here
            await core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})
        except ApiException as e:
            if e.status != 409:
                raise
        out = {}
        for p in pods:
            out[p["metadata"]["name"]] = await core.create_namespaced_pod(NS, p)
        return out
    return admin.run(go)


def delete_pods(admin: Admin, *names: str) -> None:
    async def go(api: Any) -> None:
        for n in names:
            try:
                await CoreV1Api(api).delete_namespaced_pod(n, NS, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:
                    raise
    admin.run(go)


async def _read(kubeconfig: Path, admin_kubeconfig: Path, node: str, stored: dict[str, Any]) -> dict[str, Any]:
    api = await new_client(str(kubeconfig))
    reach = Reachability(None, probe_interval=0.5, request_timeout=10)
    pods = NodePods(api, CoreV1Api(api).list_pod_for_all_namespaces, node, max_pods=1000, reach=reach,
                    on_change=lambda: None, watch_timeout=30, request_timeout=10, backoff_initial=0.2, backoff_max=2)
    task = asyncio.get_running_loop().create_task(pods.run())
    out: dict[str, Any] = {}
    try:
        await wait_for(lambda: pods.status()["answering"] or pods.refused, timeout=30, what="the pods listed")
        out["status"] = pods.status()
        out["listed"] = {n: pods.priority_of(NS, n, p.metadata.uid) for n, p in stored.items()}
        # a pod bound later is seen through the watch
        admin_api = await new_client_from_config(config_file=str(admin_kubeconfig), persist_config=False)
        try:
            late = await CoreV1Api(admin_api).create_namespaced_pod(NS, pod(f"t49-late-{node}", node,
                                                                            "system-node-critical"))
        finally:
            await admin_api.close()
        await wait_for(lambda: pods.priority_of(NS, late.metadata.name, late.metadata.uid) is not None, timeout=30,
                       what="the late pod seen")
        out["late"] = (late.spec.priority, pods.priority_of(NS, late.metadata.name, late.metadata.uid))
        # the static-pod case: kubelet's uid in the sandbox, the mirror pod's in the API server
        out["by_name"] = pods.priority_of(NS, f"t49-critical-{node}", "static-pod-config-hash")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
    return out


def test_node_reads_the_priority_of_its_own_pods_only(control_plane: ControlPlane, admin: Admin,
                                                      tmp_path: Path) -> None:
    stored = create_pods(admin, pod("t49-critical-node-a", "node-a", "system-node-critical"),
                         pod("t49-plain-node-a", "node-a"),
                         pod("t49-critical-node-b", "node-b", "system-node-critical"))
    try:
        # the Priority admission plugin set spec.priority from the class
        assert stored["t49-critical-node-a"].spec.priority == SYSTEM_NODE_CRITICAL
        assert stored["t49-plain-node-a"].spec.priority == 0
        kc = control_plane.kubelet_kubeconfig(tmp_path / "kubelet-node-a.kubeconfig", "node-a")
        got = asyncio.run(_read(kc, admin.kubeconfig, "node-a", stored))
        assert got["status"]["synced"] and not got["status"].get("error"), got["status"]
        assert got["listed"] == {"t49-critical-node-a": SYSTEM_NODE_CRITICAL, "t49-plain-node-a": 0,
                                 "t49-critical-node-b": None}  # bound elsewhere: not seen
        assert got["late"] == (SYSTEM_NODE_CRITICAL, SYSTEM_NODE_CRITICAL)
        assert got["by_name"] == SYSTEM_NODE_CRITICAL

        # the same identity may not list pods without its node's selector, nor another node's
        def list_pods(selector: str | None) -> Any:
            return Admin(kc).run(lambda api: CoreV1Api(api).list_pod_for_all_namespaces(field_selector=selector))
        for selector in (None, "spec.nodeName=node-b"):
            with pytest.raises(ApiException) as e:
                list_pods(selector)
            assert e.value.status == 403 and "can only list/watch pods with spec.nodeName" in e.value.body
    finally:
        delete_pods(admin, "t49-critical-node-a", "t49-plain-node-a", "t49-critical-node-b",
                    "t49-late-node-a")


def test_shim_status_shows_the_pod_watch(control_plane: ControlPlane, admin: Admin, shim_factory: Any,
                                        tmp_path: Path, short_tmp: Path) -> None:
    """`cri-shim status` with kubelet's kubeconfig: the pod watch synced, this node's pods counted.
    With the node's ServiceAccount of deploy/cluster/node-rbac.yaml (no right on pods): refused
    once, said in status."""
    create_pods(admin, pod("t49-status-node-a", "node-a", "system-node-critical"))
    try:
        sock = str(short_tmp / "admin.sock")
        cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": sock})
        cfg["cluster"]["kubeconfig"] = str(control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig",
                                                                            "node-a"))
        shim = shim_factory(cfg, log_level="info")
        st = wait_for_blocking(lambda: (s := shim_status(sock)).get("pod_priority", {}).get("answering") and s, 30,
                               "the pod watch synced")
        assert st["pod_priority"]["pods"] >= 1 and "error" not in st["pod_priority"]
        shim.stop()

        sock2 = str(short_tmp / "admin2.sock")
        cfg = shim_config(control_plane, tmp_path, "node-b", server={"admin_socket": sock2})
        shim_factory(cfg, log_level="info")
        st = wait_for_blocking(lambda: (s := shim_status(sock2)).get("pod_priority", {}).get("refused") and s, 30,
                               "the ServiceAccount refused")
        assert st["pod_priority"]["error"].startswith("HTTP 403"), st["pod_priority"]
        assert st["pod_priority"]["answering"] is False
    finally:
        delete_pods(admin, "t49-status-node-a")
