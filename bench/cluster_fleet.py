"""A fleet of simulated nodes against a real etcd + kube-apiserver.

    python bench/cluster_fleet.py [--nodes 100 500] [--images 50] [--mco off on] [--rest-seconds 300] [--json]

Each simulated node is the shim's own cluster code in one process: a ClusterSource (list +
watch of its Node and of the ImageSets, with bookmarks; with ``--mco on`` also ``cluster.mco:
true``, on this cluster without MCO) feeding a real ImageSets manager and Reconciler, and the
real NodeImageSetStatus writer (NodeReport) (server-side apply, coalesced). Only the runtime is simulated: it reports
every declared image present (ListImages and ImageStatus), so a set is current as soon as it is read.

Every request the API server receives is counted from its audit log (``--audit-policy-file``,
one event per request at level Metadata): 404s, 429s and failed LISTs included, which the API
server's own ``apiserver_request_total`` does not all show (a 404 for a group that is not
served is answered before a handler). The API server's own loopback requests (user
``system:apiserver``) are counted apart. Per N and MCO setting it measures:

* requests per second at rest (after every node's status shows the set, over --rest-seconds;
  at least 300 s shows watch renewals, which come every cluster.watch_timeout_seconds x 1..2),
  errors included, and the most frequent kinds of request;
* after one ImageSet change (a new image appended): the requests until the whole fleet has
  caught up, and the time until every node's status object shows the new generation.

``--rollout`` instead: a paced rollout (spec.rollout) over N nodes with the real
``cri-shim controller`` as a process, the nodes spread over ``--procs`` worker processes, each
simulating its nodes' registry (bench/fleet_rollout.py); per wave, the node-current -> next-grant
and grant -> first-registry-request latencies:

    python bench/cluster_fleet.py --rollout --nodes 1000 [--images 50] [--max-concurrent 10%] [--procs 4]

Needs scripts/setup.d/55-apiserver.sh. A benchmark: run it alone (it prints the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from kubernetes_asyncio import client  # noqa: E402
from kubernetes_asyncio.config import new_client_from_config  # noqa: E402

from shim.observability import logs  # noqa: E402
from tests.support.apiserver import ControlPlane, require_control_plane  # noqa: E402
from tests.support.kube import REPO, Admin, install  # noqa: E402
from bench.fleet_rollout import FakeRegistry, SimRuntime, create_fleet, fleet_current, rollout_run, start_node  # noqa: E402

SET = "fleet"


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]  # a watch logs ResponseStarted and ResponseComplete, any other request the latter
rules:
- level: Metadata
"""
INTERNAL = "system:apiserver"  # the API server's loopback client
BENCH_AGENT = "cluster-fleet-bench"  # this script's own requests (creating nodes, reading the statuses)


class AuditLog:
    """Every request the API server received, by audit ID, read as the log grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""
        self.requests: dict[str, tuple[float, str, str, str, int]] = {}  # id -> (received, user, verb, what, code)
        self.ours: set[str] = set()  # audit IDs of this script's own requests

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            ev = json.loads(line)
            ref = ev.get("objectRef") or {}
            what = ref.get("resource") or ev.get("requestURI", "").split("?")[0]
            if ref.get("apiGroup"):
                what = f"{what}.{ref['apiGroup']}"
            received = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            code = int((ev.get("responseStatus") or {}).get("code") or 0)
            if ev.get("userAgent") == BENCH_AGENT:
                self.ours.add(ev["auditID"])
            self.requests[ev["auditID"]] = (received, ev.get("user", {}).get("username", ""), ev.get("verb", ""),
                                            what, code)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """What arrived in [t0, t1): the fleet's requests per second, errors apart, and the API server's own."""
        self.read()
        fleet = [r for i, r in self.requests.items() if t0 <= r[0] < t1 and r[1] != INTERNAL and i not in self.ours]
        internal = sum(1 for r in self.requests.values() if t0 <= r[0] < t1 and r[1] == INTERNAL)
        seconds = t1 - t0
        errors = [r for r in fleet if r[4] >= 400]
        kinds = Counter(f"{verb} {what} {code}" for _, _, verb, what, code in fleet)
        return {"seconds": round(seconds, 1), "requests": len(fleet),
                "requests_per_second": round(len(fleet) / seconds, 3),
                "errors_per_second": round(len(errors) / seconds, 3),
                "errors": dict(Counter(f"{verb} {what} {code}" for _, _, verb, what, code in errors).most_common(5)),
                "top": dict(kinds.most_common(6)),
                "apiserver_own_per_second": round(internal / seconds, 3)}


async def fleet_run(audit: AuditLog, kubeconfig: Path, workdir: Path, n: int, images: int, mco: bool,
                    rest_seconds: float) -> dict[str, Any]:
    refs = [f"registry.example/fleet/app-{i}:v1" for i in range(images)]
    api = await new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    api.user_agent = BENCH_AGENT
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    tag = f"{n}-{'mco' if mco else 'nomco'}"
    names = [f"sim-{tag}-{i:04d}" for i in range(n)]
    created = await create_fleet(api, names, "fleet", SET, refs)
    extra = f"registry.example/fleet/extra:v{n}"
    runtime = SimRuntime("any", FakeRegistry(0.0), [*refs, extra])  # every image present: nothing is pulled
    nodes = []
    started = time.time()
    for name in names:
        nodes.append(await start_node(kubeconfig, workdir, name, runtime, mco=mco, status_interval=5))

    async def fleet_at(gen: str) -> float:
        return await fleet_current(custom, f"sim-{tag}-", SET, n, gen, period=0.25)

    gen1 = str(created["metadata"]["generation"])
    first = await fleet_at(gen1)
    start = audit.window(started, time.time())
    await asyncio.sleep(6)  # let the last writes land
    t0 = time.time()
    await asyncio.sleep(rest_seconds)
    rest = audit.window(t0, time.time())

    t0 = time.time()
    patched = await custom.patch_cluster_custom_object(
        "cri-shim.io", "v1", "imagesets", SET,
        {"spec": {"images": [{"name": r} for r in [*refs, extra]]}}, _content_type="application/merge-patch+json")
    caught_up = await fleet_at(str(patched["metadata"]["generation"]))
    change = audit.window(t0, time.time())

    for sets, src, st in nodes:
        await st.stop()
        await src.stop()
        await sets.stop()
    await custom.delete_cluster_custom_object("cri-shim.io", "v1", "imagesets", SET)
    for name in names:
        await core.delete_node(name)
    await api.close()
    return {"nodes": n, "images": images, "mco": mco, "first_all_current_seconds": round(first, 2),
            "start_requests": start["requests"], "start_errors": start["errors"],
            "rest": rest, "change_all_current_seconds": round(caught_up, 2),
            "change_requests": change["requests"], "change_errors_per_second": change["errors_per_second"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--mco", choices=("off", "on"), nargs="+", default=["off", "on"],
                    help="cluster.mco of every simulated node (this cluster has no MCO)")
    ap.add_argument("--rest-seconds", type=float, default=300.0,
                    help="the window at rest (>= 300 s shows watch renewals)")
    ap.add_argument("--rollout", action="store_true",
                    help="a paced rollout with the controller as a process instead (bench/fleet_rollout.py)")
    ap.add_argument("--max-concurrent", default="10%", help="--rollout: spec.rollout.maxConcurrentNodes")
    ap.add_argument("--pull-seconds", type=float, default=0.1,
                    help="--rollout: the simulated registry's time per image pull")
    ap.add_argument("--status-interval", type=int, default=5,
                    help="--rollout: each node's cluster.status_interval_seconds")
    ap.add_argument("--procs", type=int, default=4,
                    help="--rollout: worker processes the simulated nodes are spread over")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logs.setup("warning")
    apiserver, etcd = require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="fleet-"))
    (workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
    audit = AuditLog(workdir / "audit.log")
    cp = ControlPlane(workdir, apiserver=apiserver, etcd=etcd, extra_args=(
        "--audit-policy-file", str(workdir / "audit-policy.yaml"), "--audit-log-path", str(audit.path),
        "--audit-log-format", "json", "--audit-log-mode", "blocking", "--audit-log-maxsize", "0"))
    results = []
    try:
        cp.start()
        kubeconfig = cp.kubeconfig(workdir / "admin.kubeconfig")
        if args.rollout:
            install(kubeconfig, ())
            for n in args.nodes:
                res = asyncio.run(rollout_run(audit, cp, workdir, n, args.images, args.max_concurrent,
                                              args.pull_seconds, args.rest_seconds, args.status_interval,
                                              args.procs))
                res["load_average"] = [round(x, 2) for x in os.getloadavg()]
                results.append(res)
                print(json.dumps(res), flush=True)
            return
        admin = Admin(kubeconfig)
        admin.apply_files(REPO / "deploy" / "cluster" / "crds.yaml")
        admin.wait_served("cri-shim.io", "v1", "imagesets")
        admin.wait_served("cri-shim.io", "v1", "nodeimagesetstatuses")
        for n in args.nodes:
            for mco in args.mco:
                res = asyncio.run(fleet_run(audit, kubeconfig, workdir, n, args.images, mco == "on",
                                            args.rest_seconds))
                res["load_average"] = [round(x, 2) for x in os.getloadavg()]
                results.append(res)
                if not args.json:
                    r = res["rest"]
                    print(f"N={n} mco={mco}: all current {res['first_all_current_seconds']} s after start "
                          f"({res['start_requests']} requests, errors {res['start_errors'] or 'none'}); at rest "
                          f"({r['seconds']} s) {r['requests_per_second']} req/s, errors "
                          f"{r['errors_per_second']} req/s {r['errors'] or ''}; top {r['top']}; the API server's "
                          f"own {r['apiserver_own_per_second']} req/s; one set change: all nodes current after "
                          f"{res['change_all_current_seconds']} s, {res['change_requests']} requests; "
                          f"load average {res['load_average']}", flush=True)
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
