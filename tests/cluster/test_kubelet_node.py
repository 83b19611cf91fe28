"""A real kubelet registers its Node with the test API server; the shim in front of its
containerd, with the kubelet's own kubeconfig (its client certificate: system:node:node-k), reads
that Node's labels (set by kubelet's --node-labels) and keeps the set that selects them: pulled
through the shim, pinned, status current."""

from __future__ import annotations

from pathlib import Path

from tests.support.node import (  # noqa: F401  (fixtures)
    kubelet_factory,
    node_binaries,
    node_containerd,
    node_images,
)
from tests.support.kube import Admin

from .conftest import KUBELET_NODE
from .test_cluster_sets import SHIM, current, delete, image_set, pinned, shim_config, wait_for


def test_kubelet_registered_node_labels_select_a_set(control_plane, admin: Admin, node_containerd, node_images,
                                                     kubelet_factory, shim_factory, tmp_path: Path) -> None:
    admin.apply_custom(*SHIM, "imagesets", image_set("t5-node", [node_images.busybox.ref], {"t5-pool": "blue"}))
    try:
        kc = control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig", KUBELET_NODE)
        cfg = shim_config(control_plane, tmp_path, KUBELET_NODE)
        cfg["cluster"]["kubeconfig"] = str(kc)  # as deployed: no ServiceAccount, the node's own identity
        shim = shim_factory(cfg, upstream=node_containerd.socket, log_level="info")
        kubelet_factory(runtime_endpoint=f"unix://{shim.socket}", node_name=KUBELET_NODE,
                        args=["--kubeconfig", str(kc), "--node-labels", "t5-pool=blue"])
        node = wait_for(lambda: admin.run(lambda api: _node(api)), 120, "kubelet registered its Node", interval=0.5)
        assert node.metadata.labels["t5-pool"] == "blue"
        assert node.metadata.labels["kubernetes.io/hostname"] == KUBELET_NODE
        wait_for(lambda: pinned(shim).get(node_images.busybox.image_id), 60, "busybox pulled and pinned")
        wait_for(lambda: current(admin, KUBELET_NODE, "t5-node"), 30, "status current")
    finally:
        delete(admin, *SHIM, "imagesets", "t5-node")


async def _node(api):
    from kubernetes_asyncio.client import CoreV1Api
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return await CoreV1Api(api).read_node(KUBELET_NODE)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
