"""``bench/cluster_fleet.py --rollout``: a paced rollout over N simulated nodes (spec.rollout,
``maxConcurrentNodes``), the real ``cri-shim controller`` as a process granting them.

Each simulated node is the shim's own cluster code, as in the rest of cluster_fleet.py
(ClusterSource with its watches and the shim's grant rule, a real ImageSets manager and
Reconciler, the NodeReport status writer). The N nodes are spread over ``--procs`` worker
processes (``python -m bench.fleet_rollout worker``; node i in worker i mod procs), so that the
simulation is not what bounds the rollout. Only the runtime and the registry are simulated, in
each worker: a node's runtime answers ListImages/ImageStatus from what it holds, and PullImage
asks the worker's FakeRegistry, which holds the pull for ``--pull-seconds`` per image and records,
per node, when it served it (on CLOCK_MONOTONIC, one clock for every process of the machine); the
workers hand their records to the bench at the end. No HTTP, no bytes: what is counted is which
nodes the registry serves and when, which is what ``maxConcurrentNodes`` bounds.

Per wave (the nodes in order of their grant, ``limit`` per wave) the bench reports, from its own
watches of the ImageSet and of the NodeImageSetStatuses (times taken as each event arrives):

* ``done_to_current``: a node's last registry request served -> its status object shows the
  generation current (the node's status write, seen by the bench's watch); split on the node's
  side into ``done_to_write`` (-> the write showing it current begins) and ``write`` (that
  write's request, to the API server's answer);
* ``current_to_grant``: a node shown current -> the next grant (the k-th grant after the first
  wave paired with the k-th node shown current: the slot it freed; the controller's reaction);
* ``grant_to_request``: a node's grant -> its first registry request (the node's watch of the
  ImageSet, its grant rule and reconciler).

The set starts with images every node holds (current without a pull); after a rest window,
every image is replaced by a new one (``app-i:v2``), which each node must pull: the rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from functools import partial
from typing import Any, Protocol

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.config import new_client_from_config

from shim.cluster.informer import Informer
from shim.cluster.node_report import NodeReport
from shim.cluster.reachability import Reachability, readyz
from shim.cluster.source import ClusterSource
from shim.config import ClusterConfig, ImageSetsConfig
from shim.cri.methods import IMAGE_FS_INFO, IMAGE_STATUS, LIST_IMAGES, PULL_IMAGE
from shim.imagesets.manager import ImageSets
from shim.observability.metrics import Metrics
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler
from shim.observability import logs
from tests.support.apiserver import ControlPlane
from tests.support.kube import REPO
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


def max_overlap(spans: dict[str, tuple[float, float]]) -> int:
    """The most nodes whose (first request start, last request end) overlap at one instant."""
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    most = now = 0
    for _, d in events:  # an end sorts before a start at the same instant
        now += d
        most = max(most, now)
    return most


def max_nodes_with_a_request(spans: dict[str, list[tuple[float, float]]]) -> int:
    """The most nodes with at least one request being served at one instant (every request's span)."""
    events = sorted((t, d, node) for node, v in spans.items() for s, e in v for t, d in ((s, 1), (e, -1)))
    active: Counter[str] = Counter()
    most = 0
    for _, d, node in events:  # an end sorts before a start at the same instant
        active[node] += d
        if not active[node]:
            del active[node]
        most = max(most, len(active))
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


class TimedReport(NodeReport):
    """NodeReport that keeps, per generation of ``SET``, when the first write showing it current
    began and when the API server answered it (CLOCK_MONOTONIC)."""

    current_at: dict[str, tuple[float, float]]

    async def write(self, custom: Any) -> bool:
        began = time.monotonic()
        wrote = await super().write(custom)
        if wrote and self.last_written is not None:
            for r in self.last_written["status"]["sets"]:
                if r["name"] == SET and r.get("currentGeneration") == r["desiredGeneration"] and not r.get("reason"):
                    self.current_at.setdefault(r["currentGeneration"], (began, time.monotonic()))
        return wrote


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
    st = TimedReport(src, sets, None, interval=ccfg.status_interval_seconds, event_interval=300,
                     event_namespace="default", request_timeout=30)
    st.current_at = {}
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




# ---------------------------------------------------------------------- the worker processes

async def _worker(kubeconfig: Path, workdir: Path, names: list[str], old: list[str], pull_seconds: float,
                  status_interval: int) -> None:
    """Run ``names`` as simulated nodes until stdin says ``stop`` (or closes); then print the
    registry's spans (JSON, one line) and exit."""
    logs.setup("warning")
    registry = FakeRegistry(pull_seconds)
    nodes = []
    for name in names:
        nodes.append(await start_node(kubeconfig, workdir, name, SimRuntime(name, registry, old),
                                      mco=False, status_interval=status_interval))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for sets, src, st in nodes:
        await st.stop()
        await src.stop()
        await sets.stop()
    written = {src.node_name: st.current_at for _, src, st in nodes if isinstance(st, TimedReport)}
    print(json.dumps({"spans": registry.spans, "written": written}), flush=True)


class Workers:
    """The worker processes, node i in worker i mod ``procs``."""

    def __init__(self, kubeconfig: Path, workdir: Path, names: list[str], old: list[str], pull_seconds: float,
                 status_interval: int, procs: int) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.written: dict[str, dict[str, tuple[float, float]]] = {}
        for k in range(min(procs, len(names))):
            args = json.dumps({"kubeconfig": str(kubeconfig), "workdir": str(workdir), "names": names[k::procs],
                               "old": old, "pull_seconds": pull_seconds, "status_interval": status_interval})
            self.procs.append(subprocess.Popen([sys.executable, "-m", "bench.fleet_rollout", "worker", args],
                                               cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE))

    async def ready(self) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip() != b"ready":
                raise RuntimeError(f"a worker did not start: {line!r}")

    async def stop(self) -> dict[str, list[tuple[float, float]]]:
        """Stop every worker; the registry's spans of them all, by node (and in ``written``, per
        node and generation, the first status write showing the set current: began, answered)."""
        spans: dict[str, list[tuple[float, float]]] = {}
        for p in self.procs:
            assert p.stdin is not None
            try:
                p.stdin.write(b"stop\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            if line.strip():
                out = json.loads(line)
                for node, v in out["spans"].items():
                    spans[node] = [(a, b) for a, b in v]
                self.written.update({node: {g: (a, b) for g, (a, b) in w.items()} for node, w in out["written"].items()})
            terminate(p, timeout=10)
        return spans


class Timeline:
    """When (CLOCK_MONOTONIC, as each watch event arrives) each node was first granted ``gen``
    and first shown current at it, from watches of the ImageSet and the NodeImageSetStatuses."""

    def __init__(self, api: ApiClient, set_name: str) -> None:
        self.set_name = set_name
        self.gen = ""
        self.granted: dict[str, float] = {}
        self.current: dict[str, float] = {}
        custom = client.CustomObjectsApi(api)
        self.reach = Reachability(lambda: readyz(api, 30.0), probe_interval=1.0, request_timeout=30.0)
        common: dict[str, Any] = dict(on_change=lambda: None, reach=self.reach, request_timeout=30.0,
                                      backoff_initial=0.2, backoff_max=2.0)
        self.informers = [
            Informer(api, "bench-imagesets", partial(custom.list_cluster_custom_object, "cri-shim.io", "v1",
                                                     "imagesets"), on_event=self._set, **common),
            Informer(api, "bench-statuses", partial(custom.list_cluster_custom_object, "cri-shim.io", "v1",
                                                    "nodeimagesetstatuses"), on_event=self._status, **common)]
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.get_running_loop().create_task(i.run()) for i in self.informers]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.reach.stop()

    def _set(self, kind: str, old: Any, new: Any) -> None:
        objs = self.informers[0].items.values() if kind == "LIST" else [new]
        now = time.monotonic()
        for obj in objs:
            if not obj or obj.get("metadata", {}).get("name") != self.set_name or not self.gen:
                continue
            ro = (obj.get("status") or {}).get("rollout") or {}
            if str(ro.get("generation")) == self.gen:
                for node in ro.get("granted") or ():
                    self.granted.setdefault(node, now)

    def _status(self, kind: str, old: Any, new: Any) -> None:
        objs = self.informers[1].items.values() if kind == "LIST" else [new]
        now = time.monotonic()
        for obj in objs:
            if not obj or not self.gen:
                continue
            if any(r.get("name") == self.set_name and r.get("currentGeneration") == self.gen and not r.get("reason")
                   for r in (obj.get("status") or {}).get("sets") or ()):
                self.current.setdefault(obj["metadata"]["name"], now)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 2), "max": round(xs[-1], 2)}


def per_wave(limit: int, timeline: Timeline, spans: dict[str, list[tuple[float, float]]],
             written: dict[str, dict[str, tuple[float, float]]]) -> list[dict[str, Any]]:
    """The three latencies of each wave (the nodes in order of their grant, ``limit`` a wave)."""
    order = sorted(timeline.granted, key=lambda n: timeline.granted[n])
    currents = sorted(timeline.current.values())
    waves: list[dict[str, Any]] = []
    for w in range(math.ceil(len(order) / limit)):
        nodes = order[w * limit:(w + 1) * limit]
        to_grant = [timeline.granted[order[i]] - currents[i - limit]
                    for i in range(w * limit, w * limit + len(nodes)) if i >= limit and i - limit < len(currents)]
        to_request = [min(s for s, _ in spans[n]) - timeline.granted[n] for n in nodes if spans.get(n)]
        to_current = [timeline.current[n] - max(e for _, e in spans[n]) for n in nodes
                      if spans.get(n) and n in timeline.current]
        pull = [max(e for _, e in spans[n]) - min(s for s, _ in spans[n]) for n in nodes if spans.get(n)]
        w_at = {n: written[n][timeline.gen] for n in nodes if timeline.gen in written.get(n, {}) and spans.get(n)}
        to_write = [w_at[n][0] - max(e for _, e in spans[n]) for n in w_at]
        write = [w_at[n][1] - w_at[n][0] for n in w_at]
        waves.append({"wave": w + 1, "nodes": len(nodes), "current_to_grant": _stats(to_grant),
                      "grant_to_request": _stats(to_request), "pull": _stats(pull),
                      "done_to_current": _stats(to_current),
                      "done_to_write": _stats(to_write), "write": _stats(write)})
    return waves


async def rollout_run(audit: Audit, cp: ControlPlane, workdir: Path, n: int, images: int, max_concurrent: str,
                      pull_seconds: float, rest_seconds: float, status_interval: int = 5,
                      procs: int = 4) -> dict[str, Any]:
    kubeconfig = workdir / "admin.kubeconfig"
    old = [f"registry.example/fleet/app-{i}:v1" for i in range(images)]
    new = [f"registry.example/fleet/app-{i}:v2" for i in range(images)]
    api = await new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    api.user_agent = "cluster-fleet-bench"
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    names = [f"paced-{i:04d}" for i in range(n)]
    created = await create_fleet(api, names, "paced", SET, old, rollout={"maxConcurrentNodes": max_concurrent})
    log = open(workdir / "controller.log", "wb")
    ctl = subprocess.Popen(
        [sys.executable, "-m", "shim", "controller", "--kubeconfig",
         str(cp.controller_kubeconfig(workdir / "controller.kubeconfig")), "--identity", "bench",
         "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stat = ProcStat(ctl.pid)
    timeline = Timeline(api, SET)
    timeline.start()
    started = time.time()
    workers = Workers(kubeconfig, workdir, names, old, pull_seconds, status_interval, procs)
    spans: dict[str, list[tuple[float, float]]] = {}
    try:
        await workers.ready()

        async def all_current(gen: str) -> float:
            return await fleet_current(custom, "paced-", SET, n, gen, period=1.0)

        first = await all_current(str(created["metadata"]["generation"]))
        await asyncio.sleep(6)  # the last writes land
        c0, t0 = stat.cpu(), time.time()
        await asyncio.sleep(rest_seconds)
        rest, rest_cpu = rates(audit, t0, time.time()), stat.cpu() - c0

        c0, t0 = stat.cpu(), time.time()
        load0 = os.getloadavg()
        timeline.gen = str(created["metadata"]["generation"] + 1)  # the patch's
        patched_at = time.monotonic()
        patched = await custom.patch_cluster_custom_object(
            "cri-shim.io", "v1", "imagesets", SET, {"spec": {"images": [{"name": r} for r in new]}},
            _content_type="application/merge-patch+json")
        assert str(patched["metadata"]["generation"]) == timeline.gen
        while len(timeline.current) < n:  # the bench's watch, not a list of every status object a second
            await asyncio.sleep(0.2)
        took = time.monotonic() - patched_at
        during, during_cpu = rates(audit, t0, time.time()), stat.cpu() - c0
        load1 = os.getloadavg()
        memory = stat.memory_mib()
        obj = await custom.get_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
        await asyncio.sleep(1)  # the last status events reach the timeline
    finally:
        spans = await workers.stop()
        await timeline.stop()
        terminate(ctl, timeout=10)
        log.close()
    await custom.delete_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
    for name in names:
        await core.delete_node(name)
    await api.close()

    by_node = {node: (min(s for s, _ in v), max(e for _, e in v)) for node, v in spans.items()}
    one = statistics.median(e - s for s, e in by_node.values()) if by_node else 0.0
    status = obj.get("status") or {}
    limit = (max(1, math.ceil(n * int(max_concurrent[:-1]) / 100)) if max_concurrent.endswith("%")
             else int(max_concurrent))
    waves = math.ceil(n / limit)
    ideal = waves * one
    watched = max(timeline.current.values()) - patched_at if len(timeline.current) == n else None
    total = watched if watched is not None else took
    return {"nodes": n, "procs": len(workers.procs), "images": images, "max_concurrent_nodes": max_concurrent,
            "limit": limit, "pull_seconds_per_image": pull_seconds,
            "status_interval_seconds": status_interval, "first_all_current_seconds": round(first, 1),
            "nodes_pulled": len(by_node), "max_nodes_fetching_at_once": max_overlap(by_node),
            "max_nodes_with_a_request_at_once": max_nodes_with_a_request(spans),
            "one_node_pull_seconds_median": round(one, 2), "waves": waves, "ideal_seconds": round(ideal, 1),
            "all_current_seconds": round(took, 1),
            # the last node shown current by the bench's watch (the list above polls once a second)
            "all_current_seconds_watched": round(watched, 2) if watched is not None else None,
            "vs_ideal": round(total / ideal, 2) if ideal else None,
            "rollout_phase": (status.get("rollout") or {}).get("phase"),
            "per_wave": per_wave(limit, timeline, spans, workers.written),
            "load_average_before_after": [[round(x, 2) for x in load0], [round(x, 2) for x in load1]],
            "rest": rest, "during": during,
            "controller_cpu_seconds": {"rest": round(rest_cpu, 2), "rest_window": rest["seconds"],
                                       "rollout": round(during_cpu, 2), "rollout_window": during["seconds"]},
            "controller_memory_mib": memory, "start_seconds": round(time.time() - started, 1)}


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _a = json.loads(sys.argv[2])
    asyncio.run(_worker(Path(_a["kubeconfig"]), Path(_a["workdir"]), _a["names"], _a["old"], _a["pull_seconds"],
                        _a["status_interval"]))
