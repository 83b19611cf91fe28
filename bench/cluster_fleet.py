"""A fleet of simulated nodes against a real etcd + kube-apiserver.

    python bench/cluster_fleet.py [--nodes 100 500] [--images 50] [--rest-seconds 20] [--json]

Each simulated node is the shim's own cluster code in one process: a ClusterSource (list +
watch of its Node and of the ImageSets, with bookmarks) feeding a real ImageSets manager and
Reconciler, and the real NodeStatus writer (server-side apply, coalesced). Only the runtime is
simulated: it reports every declared image present, so a set is current as soon as it is read.
Per N it measures, from the API server's own ``apiserver_request_total``:

* requests per second at rest (after every node's status shows the set, over --rest-seconds);
* after one ImageSet change (a new image appended): requests per second until the whole fleet
  has caught up, and the time until every node's status object shows the new generation.

Needs scripts/setup.d/55-apiserver.sh. MCO resources are off (cluster.mco: false).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from kubernetes_asyncio import client  # noqa: E402
from kubernetes_asyncio.config import new_client_from_config  # noqa: E402

from shim.observability import logs  # noqa: E402
from shim.cluster.source import ClusterSource  # noqa: E402
from shim.cluster.status import NodeStatus  # noqa: E402
from shim.config import ClusterConfig, ImageSetsConfig  # noqa: E402
from shim.imagesets.manager import ImageSets  # noqa: E402
from shim.cri.methods import LIST_IMAGES  # noqa: E402
from shim.observability.metrics import Metrics  # noqa: E402
from shim.proto.runtime.v1 import api_pb2  # noqa: E402
from shim.pulls.scheduler import PullScheduler  # noqa: E402
from tests.support.apiserver import ControlPlane, require_control_plane  # noqa: E402
from tests.support.kube import REPO, Admin  # noqa: E402

SET = "fleet"


class AllPresent:
    """A runtime that has every image a set declares (ListImages answers with them)."""

    def __init__(self) -> None:
        self.refs: list[str] = []

    async def unary(self, method: str, request: bytes, **_: Any) -> bytes:
        assert method == LIST_IMAGES, method
        return api_pb2.ListImagesResponse(images=[api_pb2.Image(id=f"sha256:{i:064x}", repo_tags=[r])
                                                  for i, r in enumerate(self.refs)]).SerializeToString()


def requests_total(cp: ControlPlane) -> float:
    ctx = ssl.create_default_context(cafile=str(cp.ca))
    req = urllib.request.Request(f"{cp.url}/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^apiserver_request_total\{[^}]*\} (\S+)$", text, re.M))


async def fleet_run(cp: ControlPlane, kubeconfig: Path, workdir: Path, n: int, images: int,
                    rest_seconds: float) -> dict[str, Any]:
    refs = [f"registry.example/fleet/app-{i}:v1" for i in range(images)]
    api = await new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    names = [f"sim-{n}-{i:04d}" for i in range(n)]
    for name in names:
        await core.create_node({"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "labels": {"fleet": "yes"}}})
    body = {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": SET},
            "spec": {"nodeSelector": {"matchLabels": {"fleet": "yes"}}, "pin": True,
                     "images": [{"name": r} for r in refs]}}
    created = await custom.create_cluster_custom_object("cri-shim.io", "v1", "imagesets", body)
    runtime = AllPresent()
    runtime.refs = refs + [f"registry.example/fleet/extra:v{n}"]
    nodes = []
    cfg_sets = ImageSetsConfig()
    for name in names:
        metrics = Metrics()
        sets = ImageSets(cfg_sets, runtime, PullScheduler(4, 2), metrics, on_pins=lambda p: None)  # type: ignore[arg-type]
        ccfg = ClusterConfig(kubeconfig=str(kubeconfig), node_name=name, mco=False,
                             state_file=str(workdir / f"{name}.json"), status_interval_seconds=5)
        src = ClusterSource(ccfg, sets, metrics)
        await sets.start()
        await src.start()
        st = NodeStatus(src, sets, None, interval=ccfg.status_interval_seconds, event_interval=300,
                        event_namespace="default", request_timeout=30)
        st.start()
        nodes.append((name, sets, src, st))

    async def fleet_at(gen: str) -> float:
        t0 = time.monotonic()
        while True:
            try:
                objs = await custom.list_cluster_custom_object("cri-shim.io", "v1", "nodeimagesetstatuses",
                                                               _request_timeout=60)
            except Exception as e:  # a loaded API server: ask again
                print(f"listing the status objects: {type(e).__name__}: {e}", file=sys.stderr)
                await asyncio.sleep(1)
                continue
            done = sum(1 for o in objs["items"] if o["metadata"]["name"].startswith(f"sim-{n}-") and any(
                r["name"] == SET and r.get("currentGeneration") == gen for r in o["status"].get("sets", [])))
            if done == n:
                return time.monotonic() - t0
            await asyncio.sleep(0.25)

    gen1 = str(created["metadata"]["generation"])
    first = await fleet_at(gen1)
    await asyncio.sleep(6)  # let the last writes land
    r0, t0 = requests_total(cp), time.monotonic()
    await asyncio.sleep(rest_seconds)
    rest_rps = (requests_total(cp) - r0) / (time.monotonic() - t0)

    r0, t0 = requests_total(cp), time.monotonic()
    patched = await custom.patch_cluster_custom_object(
        "cri-shim.io", "v1", "imagesets", SET,
        {"spec": {"images": [{"name": r} for r in runtime.refs]}}, _content_type="application/merge-patch+json")
    caught_up = await fleet_at(str(patched["metadata"]["generation"]))
    change_requests = requests_total(cp) - r0
    change_rps = change_requests / (time.monotonic() - t0)

    for _, sets, src, st in nodes:
        await st.stop()
        await src.stop()
        await sets.stop()
    await custom.delete_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
    for name in names:
        await core.delete_node(name)
    await api.close()
    return {"nodes": n, "images": images, "first_all_current_seconds": round(first, 2),
            "rest_requests_per_second": round(rest_rps, 2),
            "change_all_current_seconds": round(caught_up, 2),
            "change_requests": int(change_requests), "change_requests_per_second": round(change_rps, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--rest-seconds", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logs.setup("warning")
    apiserver, etcd = require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="fleet-"))
    cp = ControlPlane(workdir, apiserver=apiserver, etcd=etcd)
    results = []
    try:
        cp.start()
        kubeconfig = cp.kubeconfig(workdir / "admin.kubeconfig")
        admin = Admin(kubeconfig)
        admin.apply_files(REPO / "deploy" / "cluster" / "crds.yaml")
        admin.wait_served("cri-shim.io", "v1", "imagesets")
        admin.wait_served("cri-shim.io", "v1", "nodeimagesetstatuses")
        for n in args.nodes:
            res = asyncio.run(fleet_run(cp, kubeconfig, workdir, n, args.images, args.rest_seconds))
            results.append(res)
            if not args.json:
                print(f"N={n}: all current {res['first_all_current_seconds']} s after start; at rest "
                      f"{res['rest_requests_per_second']} req/s; one set change: all nodes current after "
                      f"{res['change_all_current_seconds']} s, {res['change_requests']} requests "
                      f"({res['change_requests_per_second']} req/s)", flush=True)
    except BaseException:
        print(cp.log_tail(3000), file=sys.stderr)
        raise
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
