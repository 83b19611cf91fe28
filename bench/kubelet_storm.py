"""Pull storm from a real kubelet: the shim's cap against kubelet's own pull limits.

    python bench/kubelet_storm.py [--pods 24] [--images 3] [--image-mib 8] [--link-mibps 6]
                                  [--runs a,b,c,d] [--repeat 1] [--json]

A standalone kubelet v1.35 (static pods, the node suite's tests/support/node.py) runs
``--pods`` pods, pod ``i`` using image ``i % images`` (busybox plus incompressible filler,
``--image-mib`` MiB in all), on containerd 2.x + runc. The registry sits behind the
counting proxy of tests/support, its blob bodies sharing one ``--link-mibps`` link. Every
run starts on a fresh containerd (empty content store; the pause image is pulled first,
outside the counts) and a fresh kubelet:

* a: kubelet's default, ``serializeImagePulls: true``;
* b: ``serializeImagePulls: false``;
* c: (b) with ``maxParallelImagePulls: 2`` (KEP-3673);
* d: (b) with kubelet's image and runtime endpoints at the shim, ``pulls.max_parallel: 2``.

``registryPullQPS: 0`` (no client-side QPS limit) in every run, as in the node suite: with
kubelet's default of 5 (burst 10) a burst of 24 pulls fails partly with "pull QPS exceeded"
and waits out kubelet's back-off, which would measure the back-off, not the pull limits.

Reported per run: seconds from writing the manifests until each pod's container is Running
(p50, max); manifest resolves (answered manifest requests by tag) and all manifest requests,
blob bytes served, the most images with a registry request in flight at once (counting
proxy); the PullImage calls kubelet made and those that reached containerd (containerd's
``PullImage "<ref>"`` log lines; through the shim, kubelet's calls are the shim's
``cri_shim_pull_requests_total``). With ``--repeat N`` the runs are interleaved
(a, b, c, d, a, b, ...) and the table shows each figure's range over the N rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from bench.pull_storm import manifest_resolves  # noqa: E402
from tests.support.crictl import Crictl  # noqa: E402
from tests.support.node import (  # noqa: E402
    Kubelet, NodeContainerd, build_node_images, require_node, rootfs_image, rootfs_layer, running_containers,
    static_pod,
)
from tests.support.oci import PushedImage  # noqa: E402
from tests.support.registry import RegistryWithProxy, free_port  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

MiB = 1 << 20
RUNS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    # name: (what, kubelet config, the shim's pulls.max_parallel or None for no shim)
    "a": ("kubelet serializeImagePulls: true (default)", {"serializeImagePulls": True}, None),
    "b": ("kubelet serializeImagePulls: false", {"serializeImagePulls": False}, None),
    "c": ("(b) + maxParallelImagePulls: 2", {"serializeImagePulls": False, "maxParallelImagePulls": 2}, None),
    "d": ("(b) through the shim, pulls.max_parallel: 2", {"serializeImagePulls": False}, 2),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def push_images(reg: RegistryWithProxy, busybox_layer: Any, count: int, total_bytes: int) -> list[PushedImage]:
    filler = max(0, total_bytes - len(busybox_layer.blob.data))
    run = f"{time.time_ns():x}"
    return [reg.push(rootfs_image([busybox_layer, rootfs_layer({"filler.bin": (os.urandom(filler), 0o644)})],
                                  cmd=["sleep", "3600"], unique=f"kstorm-{run}-{i}"), f"kstorm/app{i}", "1")
            for i in range(count)]


def scrape(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def runtime_pull_calls(ctd_log: str) -> int:
    """containerd 2.x logs ``PullImage "<ref>"`` (info) when a CRI PullImage call arrives."""
    return sum(1 for line in ctd_log.splitlines() if 'msg="PullImage \\"' in line
               and "returns image reference" not in line and "failed" not in line and " for runtime " not in line)


def one_run(name: str, binaries: tuple[str, str], reg: RegistryWithProxy, pause_ref: str, images: list[PushedImage],
            pods: int, link_bps: int, base: Path, timeout: float) -> dict[str, Any]:
    what, kubelet_config, max_parallel = RUNS[name]
    proxy = reg.proxy
    assert proxy is not None
    work = Path(tempfile.mkdtemp(prefix=f"ks{name}-", dir=base))
    ctd = NodeContainerd(binaries[0], work / "c", sandbox_image=pause_ref, registries=[reg.host]).start()
    direct = Crictl(ctd.endpoint, timeout=60)
    shim: ShimProcess | None = None
    kubelet: Kubelet | None = None
    try:
        if direct.pull(pause_ref).returncode != 0:
            raise RuntimeError("cannot pull the pause image")
        endpoint = ctd.endpoint
        metrics = f"127.0.0.1:{free_port()}"
        if max_parallel is not None:
            shim = ShimProcess(work / "shim", upstream=ctd.socket, socket_path=work / "shim.sock", log_level="info",
                               config={"pulls": {"max_parallel": max_parallel}, "metrics": {"address": metrics}})
            shim.start()
            endpoint = shim.endpoint
        kubelet = Kubelet(binaries[1], work / "k", runtime_endpoint=endpoint, image_endpoint=endpoint,
                          config={"registryPullQPS": 0, **kubelet_config}).start()
        kubelet.wait_healthy()
        log_offset = len(ctd.log())
        proxy.reset()
        proxy.set_link_throttle(link_bps)
        names = {kubelet.pod_name(f"p{n}"): n for n in range(pods)}
        t0 = time.monotonic()
        for n in range(pods):
            kubelet.add_static_pod(static_pod(f"p{n}", images[n % len(images)].ref))
        seen: dict[str, float] = {}
        while len(seen) < pods:
            now = time.monotonic() - t0
            if now > timeout:
                raise RuntimeError(f"run {name}: only {len(seen)}/{pods} pods Running after {timeout:.0f} s\n"
                                   f"{kubelet.log_tail(30)}")
            for pod in running_containers(direct).keys() & names.keys():
                seen.setdefault(pod, now)
            time.sleep(0.25)
        stats = proxy.stats()
        records = proxy.records()
        at_runtime = runtime_pull_calls(ctd.log()[log_offset:])
        times = sorted(seen.values())
        return {
            "run": name, "what": what,
            "p50_seconds": round(statistics.median(times), 1), "max_seconds": round(times[-1], 1),
            "manifest_resolves": manifest_resolves(records), "manifest_requests": stats.manifest_requests,
            "blob_bytes": stats.blob_bytes, "max_concurrent_images": stats.max_concurrent_images,
            "kubelet_pull_calls": round(scrape(metrics, "cri_shim_pull_requests_total")) if shim else at_runtime,
            "runtime_pull_calls": at_runtime,
        }
    finally:
        proxy.set_link_throttle(None)
        if kubelet is not None:
            kubelet.close()
        ctd.close(direct)
        if shim is not None:
            shim.stop()
        shutil.rmtree(work, ignore_errors=True)


def span(rows: list[dict[str, Any]], key: str, fmt: str = "{}") -> str:
    lo, hi = (fmt.format(f(r[key] for r in rows)) for f in (min, max))
    return lo if lo == hi else f"{lo}–{hi}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; a figure that differs between rounds shows its range."""
    head = ("| run | pods Running p50 | max | manifest resolves (all manifest requests) | blob bytes "
            "| most images downloading at once | PullImage calls kubelet made (reaching containerd) |\n"
            "| --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for name in RUNS:
        rs = [r for r in rows if r["run"] == name]
        if not rs:
            continue
        mib = [{"blob_mib": r["blob_bytes"] / MiB} for r in rs]
        lines.append(f"| ({name}) {rs[0]['what']} | {span(rs, 'p50_seconds', '{:.1f}')} s "
                     f"| {span(rs, 'max_seconds', '{:.1f}')} s | {span(rs, 'manifest_resolves')} "
                     f"({span(rs, 'manifest_requests')}) | {span(mib, 'blob_mib', '{:.1f}')} MiB "
                     f"| {span(rs, 'max_concurrent_images')} | {span(rs, 'kubelet_pull_calls')} "
                     f"({span(rs, 'runtime_pull_calls')}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=24)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--image-mib", type=float, default=8.0, help="each image's size on the wire (default 8)")
    ap.add_argument("--link-mibps", type=float, default=6.0, help="registry link shared by all blob bodies")
    ap.add_argument("--runs", default="a,b,c,d")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the runs, interleaved (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not set(runs) <= RUNS.keys() or args.pods < 1 or args.images < 1:
        ap.error("runs from a,b,c,d; pods and images >= 1")
    binaries = require_node()
    base = Path(tempfile.mkdtemp(prefix="kstorm-", dir="/tmp"))
    reg = RegistryWithProxy(base / "registry")
    rows = []
    try:
        reg.start()
        node = build_node_images(reg, base / "images")
        images = push_images(reg, node.busybox_layer, args.images, int(args.image_mib * MiB))
        log(f"{args.pods} pods over {args.images} images of {images[0].image.size / MiB:.1f} MiB, "
            f"link {args.link_mibps:g} MiB/s")
        for name in [n for _ in range(max(1, args.repeat)) for n in runs]:
            log(f"run ({name}) {RUNS[name][0]} ...")
            rows.append(one_run(name, binaries, reg, node.pause.ref, images, args.pods,
                                int(args.link_mibps * MiB), base, args.timeout))
            log(f"  {rows[-1]}")
    finally:
        reg.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
