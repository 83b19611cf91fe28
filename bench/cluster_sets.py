"""Large image sets from the API server beside the same sets from files, in one run (issue 47).

    python bench/cluster_sets.py [--sets 25] [--per-set 4000] [--seconds 60] [--edit-seconds 30]
                                 [--cases api file] [--json]

Starts a real etcd + kube-apiserver (scripts/setup.d/55-apiserver.sh, as tests/cluster does),
docker-registry behind the counting proxy of tests/support and a private containerd (root in
/dev/shm). Every declared image is a name the registry answers 404 for. Two shims, one after
the other, each in front of containerd with a kubelet-like client (bench/node_scale.py's:
Version and ImageStatus through the shim every 20 ms, one gRPC channel) and, beside it, a
client calling containerd directly (``direct``: what the runtime itself answers meanwhile).
Both shims pin one image that never exists (``ANCHOR_PIN``), so ImageStatus is intercepted in
every window, the anchor included (a shim with nothing pinned relays it):

* ``api``: a shim with ``cluster.*`` set (its Node exists, labelled ``bench=yes``):
  ``idle, before the sets`` (the anchor: no set selects the node); then ``--sets`` ImageSets of
  ``--per-set`` images (``pin: true``) are created and ``after applying`` is measured
  (``--seconds``, from the last create) and ``after applying, nobody calling`` (both clients
  paused: the shim's CPU with the sets and nothing else asked of it, the first pass still
  running); then ``re-applied every 2 s``: one set applied again (server-side apply) every 2 s
  with one image renamed (a new generation), for ``--edit-seconds``; then, once every image has
  been tried once (at most ``--rest-timeout``), ``at rest``, ``at rest, nobody calling`` and
  ``at rest, a minute later`` (called again, the pass's tail behind).
* ``file``: a shim with ``image_sets.dir`` and the same windows: the anchor with an empty
  directory, then one file per set written, then one file rewritten every 2 s the same way.

Per window: Version and ImageStatus p50/p99/max (ms), the shim's CPU (share of one core) and
RSS, and its children's (the parser process). The machine may be shared: the load average is
printed with every window. Needs containerd, docker-registry, kube-apiserver and etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from bench.node_scale import _DIRECT, Kubelet, Progress, idle, measure, write  # noqa: E402
from tests.support import image_fleet  # noqa: E402
from tests.support.apiserver import ControlPlane, require_control_plane  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.kube import Admin, install  # noqa: E402
from tests.support.registry import RegistryWithProxy, free_port  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

SHIM = ("cri-shim.io", "v1")
NODE = "bench-node"
EDIT_EVERY = 2.0
# Pinned by every shim of the bench, and never present: with a pin in force the shim intercepts
# ImageStatus (and ListImages) whether or not a set is declared (shim/process/app.py's table), so
# the anchor's ImageStatus is the same intercepted call as after the sets. Before, the api case's
# anchor had nothing pinned and relayed it: "ImageStatus slower at rest" was that switch.
ANCHOR_PIN = "example.invalid/cri-shim-bench/anchor:never"


def image_set(name: str, refs: list[str]) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
            "spec": {"nodeSelector": {"matchLabels": {"bench": "yes"}}, "pin": True,
                     "images": [{"name": r} for r in refs]}}


def set_file(name: str, refs: list[str]) -> str:
    items = "".join(f"  - name: {r}\n" for r in refs)
    return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata:\n  name: {name}\nspec:\n  pin: true\n  images:\n{items}"


def failed(port: int, names: list[str]) -> int:
    """Images of the sets the shim has tried and failed so far (the first pass's progress)."""
    return int(sum(image_fleet.metric(port, "cri_shim_image_set_images", {"set": s, "state": "failed"}) or 0
                   for s in names))


def run(sets: int, per_set: int, seconds: float, edit_seconds: float, anchor_seconds: float,
        cases: tuple[str, ...] = ("api", "file"), rest_timeout: float = 900) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-csets-", dir="/tmp"))
    ctd_dir = Path(tempfile.mkdtemp(prefix="bench-csets-ctd-", dir="/dev/shm"))
    (workdir / "kube").mkdir()
    cp: ControlPlane | None = None
    if "api" in cases:
        apiserver, etcd = require_control_plane()
        cp = ControlPlane(workdir / "kube", apiserver=apiserver, etcd=etcd, nodes=(NODE,))
    registry = RegistryWithProxy(str(workdir / "registry")).start()
    assert registry.proxy is not None
    registry.proxy.idle_seconds = 2.0  # thousands of failed pulls: see CountingProxy.idle_seconds
    ctd: Containerd | None = None
    out: dict[str, Any] = Progress({"sets": sets, "per_set": per_set, "cores": os.cpu_count()})
    admin: Admin | None = None
    try:
        if cp is not None:
            cp.start()
            admin = install(cp.kubeconfig(workdir / "admin.kubeconfig"), (NODE,))
            admin.create_node(NODE, {"kubernetes.io/hostname": NODE, "bench": "yes"})
        ctd = Containerd(ctd_dir, registries=[registry.host, registry.direct_host])
        ctd.start()
        [base] = image_fleet.push_fleet(registry, "csets", 1)
        image_fleet.pull_into(str(ctd.socket), [base.ref])
        _DIRECT.append(Kubelet(ctd.socket, base.ref))
        host = registry.host

        def refs(case: str, k: int, edit: int = 0) -> list[str]:
            out = [f"{host}/missing-{case}/s{k}:i{i}" for i in range(per_set)]
            if edit:
                out[edit % per_set] = f"{host}/missing-{case}/s{k}:edit{edit}"
            return out

        def start_shim(case: str, config: dict[str, Any]) -> tuple[ShimProcess, int]:
            port = free_port()
            assert ctd is not None
            # A pin that matches nothing: ImageStatus is intercepted from the start, in the anchor
            # as at rest (without any pin the api case's anchor relays it, and a relayed call costs
            # a fifth of an intercepted one: the anchor would not be the same call; see ANCHOR_PIN)
            shim = ShimProcess(workdir / case, upstream=ctd.socket, log_level="info",
                               config={**config, "pins": {"images": [ANCHOR_PIN]},
                                       "metrics": {"address": f"127.0.0.1:{port}"}})
            shim.start(timeout=60)
            return shim, port

        names = {case: [f"{case}-s{k}" for k in range(sets)] for case in ("api", "file")}
        for case in cases:
            (workdir / case).mkdir()
            if case == "api":
                assert cp is not None and admin is not None
                config: dict[str, Any] = {"cluster": {
                    "kubeconfig": str(cp.node_kubeconfig(workdir / "node.kubeconfig", NODE)), "node_name": NODE,
                    "state_file": str(workdir / case / "cluster-state.json")}}
            else:
                sets_dir = workdir / case / "sets"
                sets_dir.mkdir()
                config = {"image_sets": {"dir": str(sets_dir), "max_file_bytes": 16 << 20}}
            shim, port = start_shim(case, config)
            kubelet = Kubelet(shim.socket, base.ref)
            pid = shim.pid or 0
            try:
                time.sleep(3)
                out[f"{case}: idle, before the sets"] = measure(kubelet, pid, anchor_seconds)
                t0 = time.monotonic()
                for k, name in enumerate(names[case]):
                    if admin is not None and case == "api":
                        admin.apply_custom(*SHIM, "imagesets", image_set(name, refs(case, k)))
                    else:
                        write(sets_dir / f"{name}.yaml", set_file(name, refs(case, k)))
                out[f"{case}: applying seconds"] = round(time.monotonic() - t0, 1)
                out[f"{case}: after applying"] = {**measure(kubelet, pid, seconds),
                                                  "failed_so_far": failed(port, names[case])}
                out[f"{case}: after applying, nobody calling"] = idle(kubelet, pid, min(seconds, 20))
                n = [0]

                def edit() -> None:
                    n[0] += 1
                    name = names[case][0]
                    if admin is not None and case == "api":
                        admin.apply_custom(*SHIM, "imagesets", image_set(name, refs(case, 0, n[0])))
                    else:
                        write(sets_dir / f"{name}.yaml", set_file(name, refs(case, 0, n[0])))
                out[f"{case}: re-applied every 2 s"] = {**measure(kubelet, pid, edit_seconds, during=edit),
                                                        "edits": n[0], "failed_so_far": failed(port, names[case])}
                t0 = time.monotonic()  # at rest: once every image has been tried (and failed) once
                while failed(port, names[case]) < sets * per_set and time.monotonic() - t0 < rest_timeout:
                    time.sleep(2)
                done = failed(port, names[case])
                out[f"{case}: first pass done" if done >= sets * per_set else f"{case}: first pass not done"] = {
                    "failed": done, "waited_seconds": round(time.monotonic() - t0)}
                out[f"{case}: at rest"] = measure(kubelet, pid, min(seconds, 30))
                out[f"{case}: at rest, nobody calling"] = idle(kubelet, pid, min(seconds, 30))
                # once more, a minute after the pass: its tail (the last failures' retries scheduled,
                # the state and status written) is behind, what is left is the cost of being called
                out[f"{case}: at rest, a minute later"] = measure(kubelet, pid, min(seconds, 30))
            finally:
                kubelet.close()
                shim.stop()
                if admin is not None and case == "api":
                    for name in names[case]:
                        admin.custom("delete", *SHIM, "imagesets", name)
        return out
    finally:
        while _DIRECT:
            _DIRECT.pop().close()
        if ctd is not None:
            ctd.stop()
        registry.stop()
        if cp is not None:
            cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ctd_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", type=int, default=25)
    ap.add_argument("--per-set", type=int, default=4000)
    ap.add_argument("--seconds", type=float, default=60.0, help="the window after applying")
    ap.add_argument("--edit-seconds", type=float, default=30.0, help="the window of re-applies")
    ap.add_argument("--anchor-seconds", type=float, default=30.0, help="the window before the sets")
    ap.add_argument("--rest-timeout", type=float, default=900.0,
                    help="how long to wait for the first pass (every image tried once) before the rest windows")
    ap.add_argument("--cases", nargs="+", choices=("api", "file"), default=["api", "file"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.sets, args.per_set, args.seconds, args.edit_seconds, args.anchor_seconds, tuple(args.cases),
              args.rest_timeout)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
