"""The controller as an operator runs it: `kubectl apply` of deploy/cluster/ (every manifest as
shipped, the image reference replaced by this commit's image, scripts/build-image.sh, pushed to the
test registry) with kube-scheduler and kube-controller-manager running, so the Deployment's two
replicas run as pods on a real kubelet whose CRI calls go through the shim: the image is pulled
through it. A leader pod writes ImageSet.status; deleted, it is replaced by the standby within the
lease duration.

Networking without kube-proxy: tests/support/kube_controllers.py (ServiceRoute)."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support import binaries, prom
from tests.support.apiserver import KUBERNETES_SERVICE_IP, SERVICE_CIDR, ControlPlane
from tests.support.kube import DEPLOY, Admin
from tests.support.kube_controllers import (
    KubeComponent,
    ServiceRoute,
    require_kube_controllers,
    require_kubectl,
    start_controller_manager,
    start_scheduler,
)
from tests.support.node import (  # noqa: F401  (fixtures)
    NodeContainerd,
    NodeImages,
    kubelet_factory,
    node_binaries,
    node_images,
    short_dir,
)
from tests.support.crictl import Crictl
from tests.support.packaging import VERSION, build
from tests.support.registry import RegistryWithProxy, free_port

from .conftest import KUBELET_NODE
from .test_cluster_sets import SHIM, delete, image_set, shim_config, wait_for
from .test_controller import LEASE, ROUND_TRIPS, _lease, counts, set_status

NAMESPACE = "cri-shim"
APP = "app.kubernetes.io/name=cri-shim-controller"
SHIPPED_IMAGE = "image: cri-shim:latest"
#: Applied as an operator would (docs/install.md); node-rbac.yaml once per node, NODE_NAME replaced as it says.
MANIFESTS = ("crds.yaml", "rbac.yaml", "node-identity.yaml", "controller.yaml")


@pytest.fixture(scope="module")
def controller_image(node_binaries: tuple[str, str], registry: RegistryWithProxy,
                     tmp_path_factory: pytest.TempPathFactory) -> str:
    """This commit's image (scripts/build-image.sh), pushed to the session registry; its ref via the
    registry's counting proxy."""
    for tool in ("mmdebstrap", "umoci", "dpkg-shlibdeps"):
        binaries.require(tool)
    skopeo = binaries.require("skopeo")
    out = build("build-image.sh", tmp_path_factory.mktemp("controller-image")).out
    r = subprocess.run([skopeo, "copy", "--dest-tls-verify=false", f"oci:{out / 'image'}:{VERSION}",
                        f"docker://{registry.direct_host}/cri-shim:{VERSION}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return f"{registry.host}/cri-shim:{VERSION}"


@pytest.fixture
def pod_containerd(node_binaries: tuple[str, str], node_images: NodeImages,
                   registry: RegistryWithProxy) -> Iterator[NodeContainerd]:
    """containerd 2.x running pods whose network routes the Service CIDR through the host."""
    c = NodeContainerd(node_binaries[0], short_dir("podc-"), sandbox_image=node_images.pause.ref,
                       registries=[registry.host], pod_routes=[SERVICE_CIDR]).start()
    try:
        yield c
    finally:
        c.close(Crictl(c.endpoint, timeout=60))


@pytest.fixture
def kube_controllers(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[KubeComponent, KubeComponent]]:
    scheduler_bin, kcm_bin = require_kube_controllers()
    started = [start_scheduler(scheduler_bin, control_plane, tmp_path),
               start_controller_manager(kcm_bin, control_plane, tmp_path)]
    try:
        for c in started:
            c.wait_healthy()
        yield started[0], started[1]
    finally:
        for c in started:
            c.stop()
            print(f"--- {c.name} log (tail)\n{c.log_tail(3000)}")


def _apply(admin: Admin, image: str) -> None:
    """`kubectl apply -f` of deploy/cluster/, the image reference replaced."""
    kubectl = require_kubectl()
    with tempfile.TemporaryDirectory() as d:
        for name in MANIFESTS:
            text = (DEPLOY / name).read_text()
            if name == "controller.yaml":
                assert text.count(SHIPPED_IMAGE) == 1
                text = text.replace(SHIPPED_IMAGE, f"image: {image}")
            (Path(d) / name).write_text(text)
        (Path(d) / "node-rbac.yaml").write_text((DEPLOY / "node-rbac.yaml").read_text().replace("NODE_NAME", KUBELET_NODE))
        r = subprocess.run([kubectl, "--kubeconfig", str(admin.kubeconfig), "apply", "-f", d],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _pods(admin: Admin) -> list[Any]:
    return admin.run(lambda api: CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=APP)).items


def _running(admin: Admin) -> dict[str, Any]:
    """name -> pod, for the controller's pods Running with their container ready."""
    return {p.metadata.name: p for p in _pods(admin) if p.metadata.deletion_timestamp is None
            and p.status.phase == "Running" and all(c.ready for c in p.status.container_statuses or [])}


def _holder_pod(admin: Admin) -> str:
    """The pod holding the Lease (identities are POD_NAME + '_' + 8 hex digits)."""
    lease = _lease(admin)
    holder = str(lease.spec.holder_identity or "") if lease is not None else ""
    return holder.rsplit("_", 1)[0] if "_" in holder else ""


def _node_ready(admin: Admin) -> bool:
    async def go(api: Any) -> bool:
        try:
            node = await CoreV1Api(api).read_node(KUBELET_NODE)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    return admin.run(go)


def _delete_node(admin: Admin) -> None:
    try:
        admin.run(lambda api: CoreV1Api(api).delete_node(KUBELET_NODE))
    except ApiException as e:
        if e.status != 404:
            raise
    delete(admin, *SHIM, "nodeimagesetstatuses", KUBELET_NODE)


def _pulls_through_shim(metrics_address: str) -> float:
    scrape = asyncio.run(prom.scrape(metrics_address))
    return sum(v for (name, labels), v in scrape.samples.items()
               if name == "cri_shim_rpc_duration_seconds_count" and dict(labels).get("method") == "PullImage"
               and dict(labels).get("code") == "OK")


def _delete_deployment(admin: Admin) -> None:
    from kubernetes_asyncio.client import AppsV1Api

    try:
        admin.run(lambda api: AppsV1Api(api).delete_namespaced_deployment(
            "cri-shim-controller", NAMESPACE, propagation_policy="Foreground"))
    except ApiException as e:
        if e.status != 404:
            raise
    # its pods stop (SIGTERM: the leader releases the Lease) before other tests run controllers
    wait_for(lambda: not _pods(admin), 90, "the controller's pods gone", interval=0.5)


def test_controller_deployment_runs_as_pods_pulled_through_the_shim(
        control_plane: ControlPlane, admin: Admin, registry: RegistryWithProxy, node_images: NodeImages,
        controller_image: str, pod_containerd: NodeContainerd, shim_factory: Any, kube_controllers: Any,
        kubelet_factory: Any, tmp_path: Path) -> None:
    route = ServiceRoute(pod_containerd.bridge, KUBERNETES_SERVICE_IP, 443, ("127.0.0.1", control_plane.port)).install()
    admin.apply_custom(*SHIM, "imagesets", image_set("t6-pods", [node_images.busybox.ref], {"t6-pool": "ctl"}))
    kubelet = None
    try:
        kc = control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig", KUBELET_NODE)
        metrics = f"127.0.0.1:{free_port()}"
        cfg = shim_config(control_plane, tmp_path, KUBELET_NODE, metrics={"address": metrics})
        cfg["cluster"]["kubeconfig"] = str(kc)
        shim = shim_factory(cfg, upstream=pod_containerd.socket, log_level="info")
        kubelet = kubelet_factory(runtime_endpoint=f"unix://{shim.socket}", node_name=KUBELET_NODE,
                                  args=["--kubeconfig", str(kc), "--node-labels", "t6-pool=ctl"])
        wait_for(lambda: _node_ready(admin), 120, "the kubelet's Node Ready", interval=0.5)
        pulls_before = _pulls_through_shim(metrics)
        _apply(admin, controller_image)

        def why() -> str:
            return (f"pods: {[(p.metadata.name, p.status.phase, p.spec.node_name) for p in _pods(admin)]}\n"
                    f"--- kubelet\n{kubelet.log_tail(40)}\n--- shim\n{shim.log_tail(20)}")
        try:
            pods = wait_for(lambda: len(_running(admin)) == 2 and _running(admin), 300, "2 controller pods Running",
                            interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{why()}") from None
        assert {p.spec.node_name for p in pods.values()} == {KUBELET_NODE}
        # the image came from the registry, pulled by kubelet through the shim
        assert registry.stats().manifest_requests_for("cri-shim", VERSION) >= 1
        assert _pulls_through_shim(metrics) > pulls_before

        # a pod leads, and writes the set's status: the node (its shim) is current
        wait_for(lambda: _holder_pod(admin) in pods, 60, "a pod holds the Lease")
        wait_for(lambda: counts(admin, "t6-pods")[:2] == (1, 1), 120, "ImageSet.status: selected 1, current 1",
                 interval=0.5)
        assert set_status(admin, "t6-pods")["observedGeneration"] == 1

        # the leader pod deleted: the standby holds the Lease and writes within the lease duration
        time.sleep(3)  # the standby has seen the Lease renewed
        before = _lease(admin)
        leader = _holder_pod(admin)
        assert leader in pods
        (standby,) = set(pods) - {leader}
        deleted_at, deleted = datetime.datetime.now(datetime.timezone.utc), time.monotonic()  # before the request
        admin.run(lambda api: CoreV1Api(api).delete_namespaced_pod(leader, NAMESPACE))
        wait_for(lambda: _holder_pod(admin) == standby, LEASE, "the standby pod holds the Lease", interval=0.1)
        took = time.monotonic() - deleted
        # a change only the new leader can write into the set's status (the old one has let go)
        admin.apply_custom(*SHIM, "imagesets", image_set("t6-pods", [node_images.busybox.ref, node_images.pause.ref],
                                                         {"t6-pool": "ctl"}))
        wait_for(lambda: set_status(admin, "t6-pods").get("observedGeneration") == 2, LEASE + ROUND_TRIPS - took,
                 "the new leader's status for generation 2", interval=0.1)
        after = _lease(admin)
        # taken after the deletion, by a transition of its own (not a Lease the standby already held)
        assert after.spec.acquire_time >= deleted_at, (before.spec, after.spec)  # one host: one clock
        assert after.spec.lease_transitions > before.spec.lease_transitions, (before.spec, after.spec)
        print(f"\nleader pod {leader} deleted: {standby} held the Lease after {took:.2f} s and wrote the set's "
              f"status after {time.monotonic() - deleted:.2f} s (lease {LEASE:.0f} s)")
        # the Deployment replaces the deleted pod
        wait_for(lambda: len(_running(admin)) == 2 and leader not in _running(admin), 120, "a new replica Running",
                 interval=1)
    finally:
        _delete_deployment(admin)
        delete(admin, *SHIM, "imagesets", "t6-pods")
        route.remove()
        if kubelet is not None:  # its Node goes with it: kubelet keeps the labels of a Node it finds registered
            kubelet.stop()
        _delete_node(admin)
