"""``bench/cluster_fleet.py --rollout``: a paced rollout over N simulated nodes (spec.rollout,
``maxConcurrentNodes``), the real ``cri-shim controller`` as a process granting them.

Each simulated node is the shim's own cluster code, as in the rest of cluster_fleet.py
(ClusterSource with its watches and the shim's grant rule, a real ImageSets manager and
Reconciler, the NodeReport status writer), all N in this one asyncio process. Only the runtime
and the registry are simulated, in process: a node's runtime answers ListImages/ImageStatus from
what it holds, and PullImage asks the FakeRegistry, which holds the pull for ``--pull-seconds``
per image and records, per node, when it served it. No HTTP, no bytes: what is counted is which
nodes the registry serves and when, which is what ``maxConcurrentNodes`` bounds.

The set starts with images every node holds (current without a pull); after a rest window,
every image is replaced by a new one (``app-i:v2``), which each node must pull: the rollout.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.config import new_client_from_config

from shim.cluster.node_report import NodeReport
from shim.cluster.source import ClusterSource
from shim.config import ClusterConfig, ImageSetsConfig
from shim.cri.methods import IMAGE_FS_INFO, IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE
from shim.imagesets.manager import ImageSets
from shim.observability.metrics import Metrics
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler
from tests.support.apiserver import ControlPlane
from tests.support.procs import terminate

SET = "fleet-paced"
CONTROLLER = "cri-shim-controller"  # in the controller's ServiceAccount user name


class Audit(Protocol):
    requests: dict[str, tuple[float, str, str, str, int]]
    ours: set[str]

    def read(self) -> None: ...


class FakeRegistry:
    """Serves a pull in ``seconds`` (no bytes) and records, per node, each pull's (start, end)
    on time.monotonic: the registry side's view of which nodes it serves at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self._active: Counter[str] = Counter()  # node -> pulls being served
        self.max_nodes_at_once = 0  # nodes with at least one pull being served, at any instant

    async def serve(self, node: str) -> None:
        start = time.monotonic()
        self._active[node] += 1
        self.max_nodes_at_once = max(self.max_nodes_at_once, len(self._active))
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self._active[node] -= 1
            if not self._active[node]:
                del self._active[node]
            self.spans.setdefault(node, []).append((start, time.monotonic()))


class SimRuntime:
    """A node's runtime: holds ``present``; PullImage goes to the registry."""

    def __init__(self, node: str, registry: FakeRegistry, present: list[str]) -> None:
        self.node = node
        self.registry = registry
        self.present = {r: f"sha256:{i:064x}" for i, r in enumerate(present)}

    def _image(self, ref: str) -> api_pb2.Image:
        return api_pb2.Image(id=self.present[ref], repo_tags=[ref])

    async def unary(self, method: str, request: bytes, **_: Any) -> bytes:
        if method == LIST_IMAGES:
            return api_pb2.ListImagesResponse(images=[self._image(r) for r in self.present]).SerializeToString()
        if method == IMAGE_STATUS:
            ref = api_pb2.ImageStatusRequest.FromString(request).image.image
            resp = api_pb2.ImageStatusResponse(image=self._image(ref)) if ref in self.present else \
                api_pb2.ImageStatusResponse()
            return resp.SerializeToString()
        if method == IMAGE_FS_INFO:
            return api_pb2.ImageFsInfoResponse().SerializeToString()
        assert method == PULL_IMAGE, method
        ref = api_pb2.PullImageRequest.FromString(request).image.image
        await self.registry.serve(self.node)
        self.present.setdefault(ref, f"sha256:{len(self.present) + 1000:064x}")
        return api_pb2.PullImageResponse(image_ref=self.present[ref]).SerializeToString()


def max_overlap(spans: dict[str, list[tuple[float, float]]]) -> int:
    """The most nodes whose (first request start, last request end) overlap at one instant."""
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    most = now = 0
    for _, d in events:  # an end sorts before a start at the same instant
        now += d
        most = max(most, now)
    return most


class ProcStat:
    """CPU seconds and memory of a process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime

    def memory_mib(self) -> dict[str, float]:
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
        return out


def rates(audit: Audit, t0: float, t1: float) -> dict[str, Any]:
    """Requests per second in [t0, t1): the nodes', the controller's; errors; the most frequent."""
    audit.read()
    seen = [r for i, r in audit.requests.items() if t0 <= r[0] < t1 and i not in audit.ours
            and r[1] != "system:apiserver"]
    ctl = [r for r in seen if CONTROLLER in r[1]]
    nodes = [r for r in seen if CONTROLLER not in r[1]]
    s = t1 - t0
    return {"seconds": round(s, 1), "nodes_per_second": round(len(nodes) / s, 2),
            "controller_per_second": round(len(ctl) / s, 2),
            "errors": sum(1 for r in seen if r[4] >= 400),
            "top_nodes": dict(Counter(f"{v} {w} {c}" for _, _, v, w, c in nodes).most_common(4)),
            "top_controller": dict(Counter(f"{v} {w} {c}" for _, _, v, w, c in ctl).most_common(4))}


async def create_fleet(api: ApiClient, names: list[str], label: str, set_name: str, refs: list[str],
                       **spec: Any) -> dict[str, Any]:
    """The Nodes ``names`` (labelled ``label: yes``) and an ImageSet of ``refs`` selecting them
    (more of its spec in ``spec``); returns the ImageSet as created."""
    for name in names:
        await client.CoreV1Api(api).create_node({"apiVersion": "v1", "kind": "Node",
                                                 "metadata": {"name": name, "labels": {label: "yes"}}})
    body = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": set_name},
            "spec": {"nodeSelector": {"matchLabels": {label: "yes"}}, "pin": True,
                     "images": [{"name": r} for r in refs], **spec}}
    created: dict[str, Any] = await client.CustomObjectsApi(api).create_cluster_custom_object(
        "cri-shim.io", "v1", "imagesets", body)
    return created


async def start_node(kubeconfig: Path, workdir: Path, name: str, runtime: Any, *, mco: bool,
                     status_interval: int) -> tuple[ImageSets, ClusterSource, NodeReport]:
    """One simulated node: the shim's ClusterSource, ImageSets and NodeReport over ``runtime``."""
    metrics = Metrics()
    sets = ImageSets(ImageSetsConfig(), runtime, PullScheduler(4, 2), metrics, on_pins=lambda p: None)
    ccfg = ClusterConfig(kubeconfig=str(kubeconfig), node_name=name, mco=mco,
                         state_file=str(workdir / f"{name}.json"), status_interval_seconds=status_interval)
    src = ClusterSource(ccfg, sets, metrics)
    await sets.start()
    await src.start()
    st = NodeReport(src, sets, None, interval=ccfg.status_interval_seconds, event_interval=300,
                    event_namespace="default", request_timeout=30)
    st.start()
    return sets, src, st


async def fleet_current(custom: client.CustomObjectsApi, prefix: str, set_name: str, n: int, gen: str, *,
                        period: float) -> float:
    """Seconds until the ``n`` nodes named ``prefix...`` all report ``set_name`` current at ``gen``."""
    t0 = time.monotonic()
    while True:
        try:
            objs = await custom.list_cluster_custom_object("cri-shim.io", "v1", "nodeimagesetstatuses",
                                                           _request_timeout=60)
        except Exception as e:  # a loaded API server: ask again
            print(f"listing the status objects: {type(e).__name__}: {e}", file=sys.stderr)
            await asyncio.sleep(1)
            continue
        done = sum(1 for o in objs["items"] if o["metadata"]["name"].startswith(prefix) and any(
            r["name"] == set_name and r.get("currentGeneration") == gen and not r.get("reason")
            for r in o["status"].get("sets", [])))
        if done == n:
            return time.monotonic() - t0
        await asyncio.sleep(period)


async def rollout_run(audit: Audit, cp: ControlPlane, workdir: Path, n: int, images: int, max_concurrent: str,
                      pull_seconds: float, rest_seconds: float, status_interval: int = 5) -> dict[str, Any]:
    kubeconfig = workdir / "admin.kubeconfig"
    old = [f"registry.example/fleet/app-{i}:v1" for i in range(images)]
    new = [f"registry.example/fleet/app-{i}:v2" for i in range(images)]
    api = await new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    api.user_agent = "cluster-fleet-bench"
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    names = [f"paced-{i:04d}" for i in range(n)]
    created = await create_fleet(api, names, "paced", SET, old, rollout={"maxConcurrentNodes": max_concurrent})
    registry = FakeRegistry(pull_seconds)
    log = open(workdir / "controller.log", "wb")
    ctl = subprocess.Popen(
        [sys.executable, "-m", "shim", "controller", "--kubeconfig",
         str(cp.controller_kubeconfig(workdir / "controller.kubeconfig")), "--identity", "bench",
         "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stat = ProcStat(ctl.pid)
    nodes = []
    try:
        started = time.time()
        for name in names:
            nodes.append(await start_node(kubeconfig, workdir, name, SimRuntime(name, registry, old),
                                          mco=False, status_interval=status_interval))

        async def all_current(gen: str) -> float:
            return await fleet_current(custom, "paced-", SET, n, gen, period=1.0)

        first = await all_current(str(created["metadata"]["generation"]))
        await asyncio.sleep(6)  # the last writes land
        c0, t0 = stat.cpu(), time.time()
        await asyncio.sleep(rest_seconds)
        rest, rest_cpu = rates(audit, t0, time.time()), stat.cpu() - c0

        c0, t0 = stat.cpu(), time.time()
        patched = await custom.patch_cluster_custom_object(
            "cri-shim.io", "v1", "imagesets", SET, {"spec": {"images": [{"name": r} for r in new]}},
            _content_type="application/merge-patch+json")
        took = await all_current(str(patched["metadata"]["generation"]))
        during, during_cpu = rates(audit, t0, time.time()), stat.cpu() - c0
        memory = stat.memory_mib()
        obj = await custom.get_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
    finally:
        for sets, src, st in nodes:
            await st.stop()
            await src.stop()
            await sets.stop()
        terminate(ctl, timeout=10)
        log.close()
    await custom.delete_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
    for name in names:
        await core.delete_node(name)
    await api.close()

    spans = {node: (min(s for s, _ in v), max(e for _, e in v)) for node, v in registry.spans.items()}
    one = statistics.median(e - s for s, e in spans.values()) if spans else 0.0
    status = obj.get("status") or {}
    limit = (max(1, math.ceil(n * int(max_concurrent[:-1]) / 100)) if max_concurrent.endswith("%")
             else int(max_concurrent))
    waves = math.ceil(n / limit)
    return {"nodes": n, "images": images, "max_concurrent_nodes": max_concurrent, "limit": limit,
            "pull_seconds_per_image": pull_seconds,
            "status_interval_seconds": status_interval, "first_all_current_seconds": round(first, 1),
            "nodes_pulled": len(spans), "max_nodes_fetching_at_once": max_overlap(spans),
            "max_nodes_with_a_request_at_once": registry.max_nodes_at_once,
            "one_node_pull_seconds_median": round(one, 2), "waves": waves, "ideal_seconds": round(waves * one, 1),
            "all_current_seconds": round(took, 1), "rollout_phase": (status.get("rollout") or {}).get("phase"),
            "rest": rest, "during": during,
            "controller_cpu_seconds": {"rest": round(rest_cpu, 2), "rest_window": rest["seconds"],
                                       "rollout": round(during_cpu, 2), "rollout_window": during["seconds"]},
            "controller_memory_mib": memory, "start_seconds": round(time.time() - started, 1)}
