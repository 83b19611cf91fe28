"""Issue 49 end to end: a critical pod's pull, queued last, reaches the runtime next, because the
API server says the pod is critical.

The real kube-apiserver of the cluster suite (Node,RBAC; the Priority admission plugin sets
``spec.priority`` from ``priorityClassName``); the shim as a process, its cluster source on with
kubelet's own identity (system:node:node-a, which may list the pods bound to node-a), in front of a
scripted runtime whose pulls each last until the test releases them, ``pulls.max_parallel: 2``
(the least the cluster source allows: ``image_sets.max_parallel`` must stay below it, 1 here).

A Pod bound to node-a with ``priorityClassName: system-node-critical`` lives in an ordinary
namespace with no static-pod annotation: no ``pulls.priority_rules`` rule matches it, only the API
server knows it is critical. As root (a trusted client, as kubelet): pulls A1 and A2 take both
slots, application pulls B and C queue, then the critical pod's pull D (its sandbox config carries
the real Pod's namespace, name and uid). Released one at a time, the runtime sees A1, A2, D, B, C.
With ``cluster.pod_priority: false`` the same pulls reach it in arrival order: A1, A2, B, C, D.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from kubernetes_asyncio.client import CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from shim.process.admin import fetch_status
from shim.proto.runtime.v1 import api_pb2
from tests.support.apiserver import ControlPlane
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.kube import Admin
from tests.support.shim import ShimProcess
from tests.support.wait import wait_for

from .test_cluster_sets import shim_config

PULL = "/runtime.v1.ImageService/PullImage"
NODE = "node-a"
NS = "t49-apps"  # an ordinary namespace: no rule of the default pulls.priority_rules names it
CRITICAL_POD = "t49-order-cni"
SYSTEM_NODE_CRITICAL = 2000001000  # the built-in PriorityClass's value


class HeldPulls:
    """The runtime's PullImage: each pull is recorded when it arrives and answered when released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._release: dict[str, asyncio.Event] = {}

    async def __call__(self, request: bytes, context: Any) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        gate = self._release.setdefault(image, asyncio.Event())
        self.started.append(image)
        await gate.wait()
        return api_pb2.PullImageResponse(image_ref=f"{image}@pulled").SerializeToString()

    def release(self, image: str) -> None:
        self._release.setdefault(image, asyncio.Event()).set()


@pytest.fixture(scope="module")
def critical_pod(control_plane: ControlPlane, admin: Admin) -> Iterator[Any]:
    """The stored Pod bound to NODE with priorityClassName system-node-critical, in NS."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": CRITICAL_POD, "namespace": NS},
            "spec": {"nodeName": NODE, "priorityClassName": "system-node-critical",
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "registry.example/cni:1"}]}}

    async def create(api: Any) -> Any:
        core = CoreV1Api(api)
        for make in (lambda: core.create_namespace({"metadata": {"name": NS}}),
                     # the ServiceAccount admission plugin needs it; no controller-manager makes it here
                     lambda: core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})):
            try:
                await make()
            except ApiException as e:
                if e.status != 409:
                    raise
        return await core.create_namespaced_pod(NS, body)

    async def delete(api: Any) -> None:
        try:
            await CoreV1Api(api).delete_namespaced_pod(CRITICAL_POD, NS, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                raise

    stored = admin.run(create)
    try:
        assert stored.spec.priority == SYSTEM_NODE_CRITICAL  # admission set it from the class
        yield stored
    finally:
        admin.run(delete)


def sandbox_pull(image: str, namespace: str, name: str, uid: str) -> bytes:
    """kubelet's PullImageRequest for a pod: its sandbox config's metadata (no annotations, no labels)."""
    req = api_pb2.PullImageRequest()
    req.image.image = image
    meta = req.sandbox_config.metadata
    meta.namespace, meta.name, meta.uid = namespace, name, uid
    return req.SerializeToString()


def cli_status(admin_sock: str) -> dict[str, Any]:
    """What `cri-shim status --json` prints."""
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket", admin_sock],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pod_priority", [True, False], ids=["pod-priority", "pod-priority-off"])
async def test_critical_pods_pull_queued_last_reaches_the_runtime_after_the_running_one(
        control_plane: ControlPlane, critical_pod: Any, tmp_path: Path, short_tmp: Path, pod_priority: bool) -> None:
    held = HeldPulls()
    runtime = await FakeRuntime(socket_in(str(short_tmp), "rt.sock"), unary={PULL: held}).start()
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, NODE, server={"admin_socket": admin_sock},
                      pulls={"max_parallel": 2}, image_sets={"max_parallel": 1}, cluster={"pod_priority": pod_priority})
    cfg["cluster"]["kubeconfig"] = str(control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig", NODE))
    shim = ShimProcess(tmp_path / "shim", upstream=runtime.path, config=cfg, socket_path=short_tmp / "shim.sock",
                       log_level="info")
    tasks: list[asyncio.Task[Any]] = []
    try:
        await shim.astart()

        def source_ready() -> Any:
            cluster = cli_status(admin_sock).get("cluster", {})
            if pod_priority:
                return cluster.get("pod_priority", {}).get("answering")
            # no pod watch: the cluster source is up once its own watches have listed
            watches = cluster.get("watches", {})
            return watches and all(w["synced"] for w in watches.values()) and "pod_priority" not in cluster
        await wait_for(source_ready, 30, "the cluster source answering (cri-shim status)", interval=0.2,
                       blocking=True)

        def queued() -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = fetch_status(admin_sock)["pulls"]["queued"]
            return rows

        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            uid = critical_pod.metadata.uid
            pulls = {"A1": sandbox_pull("registry.example/app-a1:1", NS, "app-a1", "uid-app-a1"),
                     "A2": sandbox_pull("registry.example/app-a2:1", NS, "app-a2", "uid-app-a2"),
                     "B": sandbox_pull("registry.example/app-b:1", NS, "app-b", "uid-app-b"),
                     "C": sandbox_pull("registry.example/app-c:1", NS, "app-c", "uid-app-c"),
                     "D": sandbox_pull("registry.example/cni:1", NS, CRITICAL_POD, uid)}
            image = {k: api_pb2.PullImageRequest.FromString(v).image.image for k, v in pulls.items()}
            name = {v: k for k, v in image.items()}

            for k in ("A1", "A2"):  # both slots taken
                tasks.append(asyncio.ensure_future(pull(pulls[k], timeout=30)))
                await wait_for(lambda: held.started[-1:] == [image[k]], 10, f"{k} running in the runtime")
            for n, k in enumerate("BCD", start=1):
                tasks.append(asyncio.ensure_future(pull(pulls[k], timeout=30)))
                await wait_for(lambda: len(queued()) == n, 10, f"{k} queued", blocking=True)
            # what `cri-shim status` says of the queue: only the API server made D's pod critical
            ranks = {name[r["image"].removeprefix("docker.io/")]: r.get("pod_priority") for r in queued()}
            assert ranks == {"B": 0, "C": 0, "D": SYSTEM_NODE_CRITICAL if pod_priority else 0}

            for n in range(3, 6):  # release the newest running pull; the next queued one reaches the runtime
                held.release(held.started[-1])
                await wait_for(lambda: len(held.started) == n, 10, f"pull {n} in the runtime")
            for i in held.started:
                held.release(i)
            replies = await asyncio.gather(*tasks)
        order = [name[i] for i in held.started]
        assert order == (["A1", "A2", "D", "B", "C"] if pod_priority else ["A1", "A2", "B", "C", "D"])
        assert [api_pb2.PullImageResponse.FromString(r).image_ref for r in replies] == \
            [f"{image[k]}@pulled" for k in pulls]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shim.astop()
        await runtime.stop()
        print(f"--- shim log (tail)\n{shim.log_tail(40)}")
