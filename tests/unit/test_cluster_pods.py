"""The priority of the pods bound to this node, read from the API server (shim/cluster/pods.py),
against the in-process fake of it (tests/support/fake_kube.py): only this node's unfinished pods
are asked for and kept, a static pod is found by namespace/name, and while the API server does
not answer every answer is None (the pull queue's rules apply to every pod alike)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kubernetes_asyncio.client import CoreV1Api

from shim import config
from shim.cluster.pods import NodePods, field_selector
from shim.cluster.reachability import Reachability
from shim.cluster.source import ClusterSource
from shim.observability.metrics import Metrics
from tests.support.fake_kube import FakeKube
from tests.support.wait import wait_for
from tests.unit.test_cluster_api import kubeconfig
from tests.unit.test_cluster_source import FakeSets, node

PODS = "/api/v1/pods"
NODES = "/api/v1/nodes"


@pytest.fixture
async def kube() -> Any:
    api = await FakeKube().start()
    yield api
    await api.stop()


def pod(name: str, node_name: str, priority: int | None = None, *, ns: str = "default", uid: str | None = None,
        phase: str = "Pending", **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node_name, "containers": [{"name": "c", "image": "reg/app:1"}], **extra}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}",
                         "annotations": {"big": "x" * 2000}},
            "spec": spec, "status": {"phase": phase}}


def node_pods(kube: FakeKube, *, max_pods: int = 1000, backoff_initial: float = 0.05) -> NodePods:
    api = kube.client()
    reach = Reachability(None, probe_interval=0.05, request_timeout=5.0)
    return NodePods(api, CoreV1Api(api).list_pod_for_all_namespaces, "n1", max_pods=max_pods, reach=reach,
                    on_change=lambda: None, watch_timeout=30, request_timeout=5, backoff_initial=backoff_initial,
                    backoff_max=0.2)


async def running(pods: NodePods) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(pods.run())
    await wait_for(lambda: pods.status()["answering"], what="the pods listed")
    return task


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_priority_of_this_nodes_pods_only_asked_with_its_selector(kube: FakeKube) -> None:
    kube.put(PODS, pod("cni", "n1", 2000001000, ns="kube-system"))
    kube.put(PODS, pod("web", "n1", 0))
    kube.put(PODS, pod("elsewhere", "n2", 2000001000))
    kube.put(PODS, pod("old-job", "n1", 100, phase="Succeeded"))
    kube.put(PODS, pod("no-class", "n1"))  # no Priority admission: no spec.priority
    pods = node_pods(kube)
    assert pods.priority_of("kube-system", "cni", "uid-cni") is None  # not started: unknown
    task = await running(pods)
    try:
        assert pods.priority_of("kube-system", "cni", "uid-cni") == 2000001000
        assert pods.priority_of("default", "web", "uid-web") == 0
        assert pods.priority_of("default", "elsewhere", "uid-elsewhere") is None  # bound to another node
        assert pods.priority_of("default", "old-job", "uid-old-job") is None  # finished: not kept
        assert pods.priority_of("default", "no-class", "uid-no-class") is None
        assert pods.priority_of("default", "nobody", "uid-nobody") is None
        assert pods.status() == {"synced": True, "answering": True, "pods": 3, "max_pods": 1000}
        assert {p["fieldSelector"] for p in kube_queries(kube)} == {field_selector("n1")}

        # a new pod is known from its watch event; one that finishes or is deleted is forgotten
        kube.put(PODS, pod("csi", "n1", 2000000000, ns="kube-system"))
        await wait_for(lambda: pods.priority_of("kube-system", "csi", "uid-csi") == 2000000000, what="the new pod")
        kube.put(PODS, pod("web", "n1", 0, phase="Succeeded"))
        kube.remove(PODS, "cni")
        await wait_for(lambda: pods.status()["pods"] == 2, what="the finished and the deleted pod forgotten")
        assert pods.priority_of("default", "web", "uid-web") is None
        assert pods.priority_of("kube-system", "cni", "uid-cni") is None
    finally:
        await stopped(task)


def kube_queries(kube: FakeKube) -> list[dict[str, str]]:
    return [q for q in kube.queries if q["path"] == PODS]


async def test_static_pod_found_by_namespace_and_name(kube: FakeKube) -> None:
    """A static pod's sandbox carries kubelet's uid; its mirror pod in the API server has another."""
    kube.put(PODS, pod("etcd-n1", "n1", 2000001000, ns="kube-system", uid="mirror-uid"))
    pods = node_pods(kube)
    task = await running(pods)
    try:
        assert pods.priority_of("kube-system", "etcd-n1", "static-config-hash") == 2000001000
        assert pods.priority_of("default", "etcd-n1", "static-config-hash") is None  # another namespace
        # the mirror pod recreated (new uid): the name leads to the new one; the old uid is gone
        kube.remove(PODS, "etcd-n1")
        kube.put(PODS, pod("etcd-n1", "n1", 1000, ns="kube-system", uid="mirror-2"))
        await wait_for(lambda: pods.priority_of("kube-system", "etcd-n1", "x") == 1000, what="the new mirror pod")
        assert pods.priority_of("", "", "mirror-uid") is None
    finally:
        await stopped(task)


async def test_unreachable_api_server_every_answer_none_then_back(kube: FakeKube) -> None:
    kube.put(PODS, pod("cni", "n1", 2000001000, ns="kube-system"))
    pods = node_pods(kube)
    task = await running(pods)
    try:
        await kube.down()
        await wait_for(lambda: not pods.status()["answering"], what="the failing watch noticed")
        st = pods.status()
        assert st["synced"] and st["error"]  # what it knew stays, but is not used
        assert pods.priority_of("kube-system", "cni", "uid-cni") is None
        await kube.up()
        await wait_for(lambda: pods.status()["answering"], timeout=15, what="watching again")
        assert pods.priority_of("kube-system", "cni", "uid-cni") == 2000001000
    finally:
        await stopped(task)


async def test_forbidden_asked_once_every_answer_none_and_status_says_why(kube: FakeKube) -> None:
    kube.fail(PODS, 403, times=1000)
    kube.put(PODS, pod("cni", "n1", 2000001000, ns="kube-system"))
    pods = node_pods(kube)
    task = asyncio.get_running_loop().create_task(pods.run())
    try:
        await wait_for(lambda: pods.status().get("refused"), what="the 403 seen")
        assert pods.status()["error"].startswith("HTTP 403")
        assert not pods.status()["synced"]
        assert pods.priority_of("kube-system", "cni", "uid-cni") is None
        await asyncio.sleep(0.5)  # backoff_max 0.2: it would have asked again
        assert kube.count(PODS) == 1  # refused: not asked again
    finally:
        await stopped(task)


async def test_bound_pods_beyond_max_pods_not_kept(kube: FakeKube) -> None:
    for i in range(5):
        kube.put(PODS, pod(f"p{i}", "n1", i))
    pods = node_pods(kube, max_pods=3)
    task = await running(pods)
    try:
        st = pods.status()
        assert st["pods"] == 3 and st["not_kept"] == 2
        known = [i for i in range(5) if pods.priority_of("default", f"p{i}", f"uid-p{i}") == i]
        assert len(known) == 3
        kube.put(PODS, pod("late", "n1", 7))  # full: not kept
        await wait_for(lambda: pods.status()["not_kept"] == 3, what="the late pod counted")
        assert pods.priority_of("default", "late", "uid-late") is None
        kube.remove(PODS, f"p{known[0]}")  # room again: the late pod is kept at its next change
        kube.put(PODS, pod("late", "n1", 7, phase="Running"))
        await wait_for(lambda: pods.priority_of("default", "late", "uid-late") == 7, what="kept once there is room")
        assert pods.status()["pods"] == 3
    finally:
        await stopped(task)


async def test_cluster_source_starts_and_stops_the_pod_watch(kube: FakeKube, tmp_path: Path) -> None:
    kube.put(NODES, node({}))
    kube.collections["/apis/cri-shim.io/v1/imagesets"] = {}
    kube.put(PODS, pod("cni", "n1", 2000001000, ns="kube-system"))
    cfg = config.ClusterConfig(kubeconfig=kubeconfig(kube, tmp_path / "kc"), node_name="n1", mco=False,
                               state_file=str(tmp_path / "state.json"))
    src = ClusterSource(cfg, FakeSets(), Metrics())  # type: ignore[arg-type]
    assert src.pods is None and src.priority_of("kube-system", "cni", "uid-cni") is None
    await src.start()
    try:
        assert src.pods is not None
        await wait_for(lambda: src.priority_of("kube-system", "cni", "uid-cni") == 2000001000, what="read")
        st = src.status()
        assert st["pod_priority"] == {"synced": True, "answering": True, "pods": 1, "max_pods": 1000}
    finally:
        await src.stop()
    assert src.pods is None and src.priority_of("kube-system", "cni", "uid-cni") is None
    assert "pod_priority" not in src.status()


async def test_pod_priority_off_watches_no_pods(kube: FakeKube, tmp_path: Path) -> None:
    kube.put(NODES, node({}))
    kube.collections["/apis/cri-shim.io/v1/imagesets"] = {}
    cfg = config.ClusterConfig(kubeconfig=kubeconfig(kube, tmp_path / "kc"), node_name="n1", mco=False,
                               state_file=str(tmp_path / "state.json"), pod_priority=False)
    src = ClusterSource(cfg, FakeSets(), Metrics())  # type: ignore[arg-type]
    await src.start()
    try:
        await wait_for(lambda: src.status()["watches"]["node"]["synced"], what="the node read")
        assert src.pods is None and "pod_priority" not in src.status()
        assert kube.count(PODS) == 0
    finally:
        await src.stop()


# ------------------------------------------------------------------ the index, as a state machine

NAMES = ["a", "b", "c"]


class Lines:
    """A watch response's body, one JSON line at a time, as the test writes them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.ended = False

    async def readline(self) -> bytes:
        line = await self.queue.get()
        self.ended = not line
        return line

    def at_eof(self) -> bool:
        return self.ended


class Response:
    status, reason = 200, "OK"

    def __init__(self, body: bytes = b"", content: Lines | None = None) -> None:
        self.body, self.content = body, content

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class PodIndex(RuleBasedStateMachine):
    """Pods created, changed, deleted (or finished: the same to a watch with the phase selector),
    recreated under the same name with a new uid, and a re-list after 410, with a bound of 2: an
    answer is always the priority of the pod the API server has now under that uid (or, for an
    unknown uid, under that namespace/name), or None when that pod is not kept; never a stale pod's."""

    @initialize()
    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.live: dict[str, dict[str, Any]] = {}  # name -> the pod as the API server has it
        self.uids = 0
        self.rv = 1
        self.lines = Lines()

        async def list_pods(**kw: Any) -> Response:
            if kw.get("watch"):
                self.lines = Lines()
                return Response(content=self.lines)
            body = {"metadata": {"resourceVersion": str(self.rv)}, "items": list(self.live.values())}
            return Response(json.dumps(body).encode())

        self.pods = NodePods(object(), list_pods, "n1", max_pods=2,  # type: ignore[arg-type]
                             reach=Reachability(None, probe_interval=1, request_timeout=1), on_change=lambda: None)
        self.task = self.loop.create_task(self.pods.run())
        self._until(lambda: self.pods.informer.watches == 1)

    def _until(self, done: Any) -> None:
        async def wait() -> None:
            while not done():
                await asyncio.sleep(0)
        self.loop.run_until_complete(asyncio.wait_for(wait(), 5))

    def _send(self, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.lines.queue.put_nowait(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        self._until(lambda: self.pods.informer.resource_version == str(self.rv))

    @rule(name=st.sampled_from(NAMES), prio=st.integers(-10, 10))
    def create_or_change(self, name: str, prio: int) -> None:
        if name in self.live:
            self.live[name]["spec"]["priority"] = prio  # immutable in a real API server: harder on the index
            self._send("MODIFIED", self.live[name])
        else:
            self.uids += 1
            self.live[name] = pod(name, "n1", prio, uid=f"u{self.uids}")
            self._send("ADDED", self.live[name])

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        self._send("DELETED", self.live.pop(name))

    @rule()
    def relist(self) -> None:
        lists, watches = self.pods.informer.lists, self.pods.informer.watches
        self.lines.queue.put_nowait(json.dumps({"type": "ERROR", "object": {"code": 410, "reason": "Gone"}}).encode()
                                    + b"\n")
        self._until(lambda: self.pods.informer.lists == lists + 1 and self.pods.informer.watches == watches + 1)

    @invariant()
    def answers(self) -> None:
        kept = 0
        for name in NAMES:
            p = self.live.get(name)
            got = self.pods.priority_of("default", name, p["metadata"]["uid"] if p else "gone")
            by_name = self.pods.priority_of("default", name, "unknown-uid")
            if p is None:
                assert got is None and by_name is None
            else:
                assert got in (None, p["spec"]["priority"]) and by_name == got
                kept += got is not None
        live_uids = {p["metadata"]["uid"] for p in self.live.values()}
        for u in range(1, self.uids + 1):  # a uid no longer live is never answered
            if f"u{u}" not in live_uids:
                assert self.pods.priority_of("", "", f"u{u}") is None
        assert kept == self.pods.status()["pods"] <= 2

    def teardown(self) -> None:
        if hasattr(self, "task"):
            self.task.cancel()
            self.loop.run_until_complete(asyncio.gather(self.task, return_exceptions=True))
            self.loop.close()


TestPodIndex = PodIndex.TestCase
TestPodIndex.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
