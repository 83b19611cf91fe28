"""Pull storm from a real kubelet: the shim's cap against kubelet's own pull limits.

    python bench/kubelet_storm.py [--pods 24] [--images 3] [--image-mib 8] [--link-mibps 6]
                                  [--runs a,b,c,d] [--repeat 1] [--json]
    python bench/kubelet_storm.py --mixed [--big-pods 4] [--big-mib 200] [--small-pods 20]
                                  [--small-images 5] [--small-mib 5] [--gap 1] [--link-mibps 20] ...
    python bench/kubelet_storm.py --hung [--runs c,d] [--hung-kinds manifest,blob] [--hung-wait 400]
                                  [--no-progress 60]
    python bench/kubelet_storm.py --critical [--runs c,p0,p1,p2] [--app-pods 20] [--app-images 5]
                                  [--app-mib 8] [--critical-mib 1] [--gap 1] [--link-mibps 6]

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

Reported per run: seconds from writing a pod's manifest until its container is Running
(p50, max); manifest resolves (answered manifest requests by tag) and all manifest requests,
blob bytes served, the most images with a registry request in flight at once (counting
proxy); the PullImage calls kubelet made and those that reached containerd (containerd's
``PullImage "<ref>"`` log lines; through the shim, kubelet's calls are the shim's
``cri_shim_pull_requests_total``). With ``--repeat N`` the runs are interleaved
(a, b, c, d, a, b, ...) and the table shows each figure's range over the N rounds.

``--mixed``: ``--big-pods`` pods of one ``--big-mib`` image arrive first, ``--gap`` seconds
later ``--small-pods`` pods over ``--small-images`` images of ``--small-mib`` (the storm
kubelet's options handle worst). Also reported per run: seconds from writing a pod's manifest
until its image is present, from kubelet's own ``Pulled`` events (logged with
``--vmodule=event=3``), p50 and max; registry requests; and beside the table the physical limit
(distinct bytes over the link rate) and the p50 of the best order (one image at a time at the
full link rate, most pods per byte first: Smith's rule, which minimises the mean time until
present; the small images' pods arriving ``--gap`` later is ignored).

``--hung``: two pods whose registries hang (``--hung-kinds``; by default one never answers the
manifest, one's blob stops after 1.5 MiB; the counting proxy keeps the connections open for
600 s), then a healthy pod once both hung pulls reached the registry; reported: seconds until the
healthy pod is Running (at most ``--hung-wait``) and when and how the hung pulls ended (kubelet's
``Failed`` events). The shim runs with ``pulls.no_progress_timeout_seconds: --no-progress``
(default 60, the shipped default).

``--critical``: ``--app-pods`` application pods over ``--app-images`` images of ``--app-mib``
arrive, ``--gap`` seconds later one pod in ``kube-system`` of a ``--critical-mib`` image (the
shim's ``pulls.priority_rules`` make it ``system-node-critical``, as the API server's answer
would for a CNI DaemonSet pod). Reported per run: seconds from writing each pod's manifest
until its image is present (kubelet's ``Pulled`` events): the critical pod's, and the
application pods' p50 and max; and the critical pod's time on an idle node of the same
configuration (a fresh node, only that pod). Runs: (c) kubelet alone, ``maxParallelImagePulls:
2``; (p0) the shim without priority (``pulls.priority_order: false``: arrival order, the shim
before issue 49); (p1) the shim with priority; (p2) (p1) with ``pulls.critical_slots: 1``.

A warning is printed (and the load average recorded in every row) when the 1-minute load
average is above 1: on a busy machine the figures measure the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    # --critical
    "p0": ("(d) without priority (pulls.priority_order: false)", {"serializeImagePulls": False}, 2),
    "p1": ("(d) with priority", {"serializeImagePulls": False}, 2),
    "p2": ("(d) with priority and pulls.critical_slots: 1", {"serializeImagePulls": False}, 2),
}
CRITICAL_RULES = [{"priority": "system-node-critical", "namespaces": ["kube-system"]}]
CRITICAL_SHIM: dict[str, dict[str, Any]] = {  # the shim's pulls config of each --critical run
    "p0": {"priority_order": False},
    "p1": {"priority_rules": CRITICAL_RULES},
    "p2": {"priority_rules": CRITICAL_RULES, "critical_slots": 1},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def push_images(reg: RegistryWithProxy, busybox_layer: Any, count: int, total_bytes: int,
                name: str = "app") -> list[PushedImage]:
    filler = max(0, total_bytes - len(busybox_layer.blob.data))
    run = f"{time.time_ns():x}"
    return [reg.push(rootfs_image([busybox_layer, rootfs_layer({"filler.bin": (os.urandom(filler), 0o644)})],
                                  cmd=["sleep", "3600"], unique=f"kstorm-{run}-{name}{i}"), f"kstorm/{name}{i}", "1")
            for i in range(count)]


def scrape(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:  # closed now, not at the next GC
        text = response.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def runtime_pull_calls(ctd_log: str) -> int:
    """containerd 2.x logs ``PullImage "<ref>"`` (info) when a CRI PullImage call arrives."""
    return sum(1 for line in ctd_log.splitlines() if 'msg="PullImage \\"' in line
               and "returns image reference" not in line and "failed" not in line and " for runtime " not in line)


Pods = list[tuple[float, list[tuple[str, str]]]]  # (seconds to wait first, [(pod, image ref)]) in order
_EVENT = re.compile(r'^[IW](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) .*"Event occurred" object="[^"/]*/([^"]+)".* reason="(\w+)"'
                    r'(?: message="(.*)")?')


def load_average() -> float:
    return os.getloadavg()[0]


def events(kubelet_log: str, wall0: float, reason: str) -> dict[str, tuple[float, str]]:
    """Each pod's first event of ``reason`` (``Pulled``: image pulled or already present; ``Failed``),
    as (seconds after ``wall0``, message), from kubelet's log (klog times, UTC)."""
    day0 = wall0 % 86400
    seen: dict[str, tuple[float, str]] = {}
    for line in kubelet_log.splitlines():
        m = _EVENT.match(line)
        if m and m[6] == reason:
            at = int(m[2]) * 3600 + int(m[3]) * 60 + float(m[4])
            seen.setdefault(m[5], ((at - day0) % 86400, m[7] or ""))
    return seen


def start_node(name: str, binaries: tuple[str, str], reg: RegistryWithProxy, pause_ref: str, base: Path,
               shim_config: dict[str, Any] | None = None, shim_log_level: str = "info") -> tuple[Path, NodeContainerd, Crictl, ShimProcess | None,
                                                                  Kubelet, str]:
    """A fresh containerd (pause image pulled), the shim if (d), a healthy kubelet of run ``name``."""
    what, kubelet_config, max_parallel = RUNS[name]
    work = Path(tempfile.mkdtemp(prefix=f"ks{name}-", dir=base))
    ctd = NodeContainerd(binaries[0], work / "c", sandbox_image=pause_ref, registries=[reg.host]).start()
    direct = Crictl(ctd.endpoint, timeout=60)
    if direct.pull(pause_ref).returncode != 0:
        ctd.close(direct)
        raise RuntimeError("cannot pull the pause image")
    endpoint = ctd.endpoint
    metrics = f"127.0.0.1:{free_port()}"
    shim: ShimProcess | None = None
    if max_parallel is not None:
        pulls = {"max_parallel": max_parallel, **(shim_config or {})}
        shim = ShimProcess(work / "shim", upstream=ctd.socket, socket_path=work / "shim.sock", log_level=shim_log_level,
                           config={"pulls": pulls, "metrics": {"address": metrics}})
        shim.start()
        endpoint = shim.endpoint
    kubelet = Kubelet(binaries[1], work / "k", runtime_endpoint=endpoint, image_endpoint=endpoint,
                      config={"registryPullQPS": 0, **kubelet_config}, args=["--vmodule=event=3"]).start()
    kubelet.wait_healthy()
    return work, ctd, direct, shim, kubelet, metrics


def stop_node(work: Path, ctd: NodeContainerd, direct: Crictl, shim: ShimProcess | None, kubelet: Kubelet) -> None:
    kubelet.close()
    ctd.close(direct)
    if shim is not None:
        shim.stop()
    shutil.rmtree(work, ignore_errors=True)


def one_run(name: str, binaries: tuple[str, str], reg: RegistryWithProxy, pause_ref: str, pods: Pods,
            link_bps: int, base: Path, timeout: float) -> dict[str, Any]:
    proxy = reg.proxy
    assert proxy is not None
    load = load_average()
    work, ctd, direct, shim, kubelet, metrics = start_node(name, binaries, reg, pause_ref, base)
    try:
        log_offset = len(ctd.log())
        proxy.reset()
        proxy.set_link_throttle(link_bps)
        names = {kubelet.pod_name(pod): pod for _, group in pods for pod, _ in group}
        wall0, t0 = time.time(), time.monotonic()
        added: dict[str, float] = {}  # kubelet's pod name -> seconds after t0 its manifest was written
        for wait, group in pods:
            time.sleep(wait)
            for pod, ref in group:
                kubelet.add_static_pod(static_pod(pod, ref))
                added[kubelet.pod_name(pod)] = time.monotonic() - t0
        seen: dict[str, float] = {}
        while len(seen) < len(names):
            now = time.monotonic() - t0
            if now > timeout:
                raise RuntimeError(f"run {name}: only {len(seen)}/{len(names)} pods Running after {timeout:.0f} s\n"
                                   f"{kubelet.log_tail(30)}")
            for pod in running_containers(direct).keys() & names.keys():
                seen.setdefault(pod, now)
            time.sleep(0.25)
        stats = proxy.stats()
        records = proxy.records()
        at_runtime = runtime_pull_calls(ctd.log()[log_offset:])
        times = sorted(at - added[p] for p, at in seen.items())
        pulled = events(kubelet.log(), wall0, "Pulled")
        present = sorted(pulled[p][0] - added[p] for p in names if p in pulled)
        return {
            "run": name, "what": RUNS[name][0], "load_average": round(load, 1),
            "p50_seconds": round(statistics.median(times), 1), "max_seconds": round(times[-1], 1),
            "present_p50_seconds": round(statistics.median(present), 1) if present else None,
            "present_max_seconds": round(present[-1], 1) if present else None,
            "present_events": len(present),
            "manifest_resolves": manifest_resolves(records), "manifest_requests": stats.manifest_requests,
            "registry_requests": len(records),
            "blob_bytes": stats.blob_bytes, "max_concurrent_images": stats.max_concurrent_images,
            "kubelet_pull_calls": round(scrape(metrics, "cri_shim_pull_requests_total")) if shim else at_runtime,
            "runtime_pull_calls": at_runtime,
        }
    finally:
        proxy.set_link_throttle(None)
        stop_node(work, ctd, direct, shim, kubelet)


def hung_run(name: str, binaries: tuple[str, str], reg: RegistryWithProxy, pause_ref: str,
             hung: list[PushedImage], kinds: list[str], healthy: PushedImage, base: Path, wait: float,
             no_progress: float) -> dict[str, Any]:
    """Hung registries (``kinds``: manifest or blob, one per image of ``hung``), then a healthy pod:
    how long until the healthy pod is Running."""
    proxy = reg.proxy
    assert proxy is not None
    load = load_average()
    shim_config = {"no_progress_timeout_seconds": no_progress}
    work, ctd, direct, shim, kubelet, _ = start_node(name, binaries, reg, pause_ref, base, shim_config)
    try:
        proxy.reset()
        for i, (kind, image) in enumerate(zip(kinds, hung)):
            if kind == "manifest":
                proxy.hang(image.repository, manifest=True)
            else:
                proxy.hang(image.repository, blob_after=3 << 19)
            kubelet.add_static_pod(static_pod(f"hung-{kind}-{i}", image.ref))
        proxy.wait_until(lambda s: all(s.manifest_requests_for(image.repository, image.tag) > 0 for image in hung)
                         and s.inflight_blob_gets >= kinds.count("blob"), 60)
        wall0, t0 = time.time(), time.monotonic()
        kubelet.add_static_pod(static_pod("healthy", healthy.ref))
        pod = kubelet.pod_name("healthy")
        took: float | None = None
        while time.monotonic() - t0 < wait:
            if pod in running_containers(direct):
                took = time.monotonic() - t0
                break
            time.sleep(0.25)
        failed = events(kubelet.log(), wall0, "Failed")
        ended = sorted((round(at, 1), pod, message[-400:]) for pod, (at, message) in failed.items() if "hung-" in pod)
        return {"run": name, "what": RUNS[name][0], "load_average": round(load, 1),
                "hung": ",".join(kinds), "no_progress_timeout": no_progress if RUNS[name][2] else None,
                "healthy_running_seconds": None if took is None else round(took, 1), "waited_at_most": wait,
                "hung_pulls_failed": ended}
    finally:
        proxy.unhang()
        stop_node(work, ctd, direct, shim, kubelet)


def critical_run(name: str, binaries: tuple[str, str], reg: RegistryWithProxy, pause_ref: str,
                 apps: list[tuple[str, str]], critical: str, gap: float, link_bps: int, base: Path,
                 timeout: float) -> dict[str, Any]:
    """``apps`` (pod, image ref) at once, ``gap`` seconds later the critical pod of image ``critical``
    (none: the idle run, the critical pod alone): seconds until each pod's image is present."""
    proxy = reg.proxy
    assert proxy is not None
    load = load_average()
    work, ctd, direct, shim, kubelet, _ = start_node(name, binaries, reg, pause_ref, base, CRITICAL_SHIM.get(name),
                                                     shim_log_level="debug")  # "pull done" with queued_seconds
    try:
        proxy.reset()
        proxy.set_link_throttle(link_bps)
        wall0, t0 = time.time(), time.monotonic()
        added: dict[str, float] = {}
        for pod, ref in apps:
            kubelet.add_static_pod(static_pod(pod, ref))
            added[kubelet.pod_name(pod)] = time.monotonic() - t0
        if apps:
            time.sleep(gap)
        kubelet.add_static_pod(static_pod("critical", critical, namespace="kube-system"))
        crit = kubelet.pod_name("critical")
        added[crit] = time.monotonic() - t0
        while True:
            pulled = events(kubelet.log(), wall0, "Pulled")
            if added.keys() <= pulled.keys():
                break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"run {name}: {len(pulled)}/{len(added)} images present after {timeout:.0f} s")
            time.sleep(0.25)
        present = {p: pulled[p][0] - at for p, at in added.items()}
        app_times = sorted(v for p, v in present.items() if p != crit)
        queued = None  # the critical pull's wait in the shim's queue (its "pull done" debug line)
        if shim is not None:
            for line in shim.log_text().splitlines():
                if "pull done" in line and critical.rsplit("/", 1)[-1] in line:
                    m = re.search(r"queued_seconds[=\": ]+([0-9.]+)", line)
                    queued = float(m[1]) if m else None
        return {"run": name, "what": RUNS[name][0], "load_average": round(load, 1), "idle": not apps,
                "critical_seconds": round(present[crit], 2), "critical_queued_seconds": queued,
                "apps_p50_seconds": round(statistics.median(app_times), 2) if app_times else None,
                "apps_max_seconds": round(app_times[-1], 2) if app_times else None,
                "apps_seconds": {p: round(v, 2) for p, v in sorted(present.items()) if p != crit}}
    finally:
        proxy.set_link_throttle(None)
        stop_node(work, ctd, direct, shim, kubelet)


def critical_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | critical pod's image present | of which queued in the shim | on an idle node | ratio "
             "| application pods p50 | max | max vs (p0) | load |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rounds: dict[tuple[str, bool], int] = {}
    by_round: dict[tuple[str, bool, int], dict[str, Any]] = {}
    for r in rows:  # the n-th row of a run and kind is of round n: compared within its round
        n = rounds[(r["run"], r["idle"])] = rounds.get((r["run"], r["idle"]), -1) + 1
        by_round[(r["run"], r["idle"], n)] = r
    for (name, is_idle, n), r in by_round.items():
        if is_idle:
            continue
        i = by_round.get((name, True, n))
        base = by_round.get(("p0", False, n))
        ratio = f"{r['critical_seconds'] / i['critical_seconds']:.1f}x" if i else "–"
        vs = f"{r['apps_max_seconds'] / base['apps_max_seconds']:.2f}x" if base else "–"
        q = r.get("critical_queued_seconds")
        lines.append(f"| ({r['run']}) {r['what']} | {r['critical_seconds']:.1f} s | {'–' if q is None else f'{q:.1f} s'} "
                     f"| {i['critical_seconds']:.1f} s | {ratio} | {r['apps_p50_seconds']:.1f} s "
                     f"| {r['apps_max_seconds']:.1f} s | {vs} | {r['load_average']} |" if i else
                     f"| ({r['run']}) {r['what']} | {r['critical_seconds']:.1f} s | – | – | – "
                     f"| {r['apps_p50_seconds']:.1f} s | {r['apps_max_seconds']:.1f} s | {vs} | {r['load_average']} |")
    return "\n".join(lines)


def best_order(images: list[tuple[int, int]], shared: int, link_bps: float) -> tuple[float, float]:
    """(physical limit, p50 of the best order) for images given as (their own bytes, pods) and
    ``shared`` bytes every image has (the busybox layer, fetched once): the shared bytes first,
    then one image at a time at the full link rate, most pods per byte first (Smith's rule)."""
    done, at = shared / link_bps, []
    for size, n in sorted(images, key=lambda i: i[0] / i[1]):
        done += size / link_bps
        at += [done] * n
    return done, statistics.median(at)


def span(rows: list[dict[str, Any]], key: str, fmt: str = "{}") -> str:
    lo, hi = (fmt.format(f(r[key] for r in rows)) for f in (min, max))
    return lo if lo == hi else f"{lo}–{hi}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration; a figure that differs between rounds shows its range."""
    head = ("| run | image present p50 | max | pods Running p50 | max | manifest resolves (all manifest requests) "
            "| registry requests | blob bytes | most images downloading at once "
            "| PullImage calls kubelet made (reaching containerd) |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for name in RUNS:
        rs = [r for r in rows if r["run"] == name]
        if not rs:
            continue
        mib = [{"blob_mib": r["blob_bytes"] / MiB} for r in rs]
        present = [r for r in rs if r.get("present_p50_seconds") is not None]
        pres = (f"{span(present, 'present_p50_seconds', '{:.1f}')} s | {span(present, 'present_max_seconds', '{:.1f}')} s"
                if present else "– | –")
        lines.append(f"| ({name}) {rs[0]['what']} | {pres} | {span(rs, 'p50_seconds', '{:.1f}')} s "
                     f"| {span(rs, 'max_seconds', '{:.1f}')} s | {span(rs, 'manifest_resolves')} "
                     f"({span(rs, 'manifest_requests')}) | {span(rs, 'registry_requests')} "
                     f"| {span(mib, 'blob_mib', '{:.1f}')} MiB "
                     f"| {span(rs, 'max_concurrent_images')} | {span(rs, 'kubelet_pull_calls')} "
                     f"({span(rs, 'runtime_pull_calls')}) |")
    lines.append(f"\nload average (1 min) at each run's start: {span(rows, 'load_average', '{:.1f}')}")
    return "\n".join(lines)


def hung_table(rows: list[dict[str, Any]], wait: float) -> str:
    lines = ["| run | hung | shim's no-progress timeout | healthy pod Running after "
             "| the hung pulls ended (kubelet's Failed events) | load |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        took = f"{r['healthy_running_seconds']} s" if r["healthy_running_seconds"] is not None else f"not within {wait:g} s"
        ended = "; ".join(f"{pod} {at} s: …{msg[-160:]}" for at, pod, msg in r["hung_pulls_failed"]) or "not within the wait"
        timeout = f"{r['no_progress_timeout']:g} s" if r["no_progress_timeout"] else "–"
        lines.append(f"| ({r['run']}) {r['what']} | {r['hung']} | {timeout} | {took} | {ended} | {r['load_average']} |")
    return "\n".join(lines)


def warn_load() -> None:
    load = load_average()
    if load > 1:
        log(f"WARNING: load average {load:.1f} > 1: another process shares the machine; these figures measure it too")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=24)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--image-mib", type=float, default=8.0, help="each image's size on the wire (default 8)")
    ap.add_argument("--link-mibps", type=float, default=None, help="registry link shared by all blob bodies "
                    "(default 6, with --mixed 20)")
    ap.add_argument("--mixed", action="store_true", help="big pods first, then many small ones (module docstring)")
    ap.add_argument("--big-pods", type=int, default=4)
    ap.add_argument("--big-mib", type=float, default=200.0)
    ap.add_argument("--small-pods", type=int, default=20)
    ap.add_argument("--small-images", type=int, default=5)
    ap.add_argument("--small-mib", type=float, default=5.0)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between the big pods and the small ones")
    ap.add_argument("--hung", action="store_true", help="the hung-registry rows (module docstring)")
    ap.add_argument("--hung-kinds", default="manifest,blob",
                    help="how each hung registry hangs: manifest (never answered) or blob (stops after 1.5 MiB)")
    ap.add_argument("--hung-wait", type=float, default=400.0, help="seconds to wait for the healthy pod")
    ap.add_argument("--no-progress", type=float, default=60.0, help="the shim's pulls.no_progress_timeout_seconds")
    ap.add_argument("--critical", action="store_true", help="application pods, then a critical one (docstring)")
    ap.add_argument("--app-pods", type=int, default=20)
    ap.add_argument("--app-images", type=int, default=5)
    ap.add_argument("--app-mib", type=float, default=8.0)
    ap.add_argument("--critical-mib", type=float, default=1.0)
    ap.add_argument("--runs", default=None, help="default a,b,c,d (with --hung: c,d; with --critical: c,p0,p1,p2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the runs, interleaved (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    default_runs = "c,d" if args.hung else "c,p0,p1,p2" if args.critical else "a,b,c,d"
    runs = [r.strip() for r in (args.runs or default_runs).split(",") if r.strip()]
    if not set(runs) <= RUNS.keys() or args.pods < 1 or args.images < 1:
        ap.error("runs from a,b,c,d; pods and images >= 1")
    link_mibps = args.link_mibps or (20.0 if args.mixed else 6.0)
    warn_load()
    binaries = require_node()
    base = Path(tempfile.mkdtemp(prefix="kstorm-", dir="/tmp"))
    reg = RegistryWithProxy(base / "registry")
    rows: list[dict[str, Any]] = []
    extra = ""
    try:
        reg.start()
        node = build_node_images(reg, base / "images")
        if args.hung:
            tag = f"{time.time_ns():x}"
            kinds = [k.strip() for k in args.hung_kinds.split(",")]
            if not kinds or not set(kinds) <= {"manifest", "blob"}:
                ap.error("--hung-kinds: manifest or blob, comma-separated")
            hung = [node.with_filler(reg, f"kstorm/hung-{k}{i}-{tag}", 4) for i, k in enumerate(kinds)]
            for name in [n for _ in range(max(1, args.repeat)) for n in runs]:
                log(f"hung run ({name}) {RUNS[name][0]} ...")
                rows.append(hung_run(name, binaries, reg, node.pause.ref, hung, kinds, node.busybox, base, args.hung_wait,
                                     args.no_progress))
                log(f"  {rows[-1]}")
            print(json.dumps(rows, indent=2) if args.json else hung_table(rows, args.hung_wait))
            return 0
        if args.critical:
            apps = push_images(reg, node.busybox_layer, args.app_images, int(args.app_mib * MiB))
            crit = push_images(reg, node.busybox_layer, 1, int(args.critical_mib * MiB), "critical")[0]
            app_pods = [(f"app{n}", apps[n % len(apps)].ref) for n in range(args.app_pods)]
            log(f"{args.app_pods} pods over {len(apps)} images of {apps[0].image.size / MiB:.1f} MiB, then a critical "
                f"pod of {crit.image.size / MiB:.1f} MiB, link {link_mibps:g} MiB/s")
            for name in [n for _ in range(max(1, args.repeat)) for n in runs]:
                for idle in (True, False):
                    warn_load()
                    log(f"critical run ({name}) {RUNS[name][0]}{' idle' if idle else ''} ...")
                    rows.append(critical_run(name, binaries, reg, node.pause.ref, [] if idle else app_pods, crit.ref,
                                             args.gap, int(link_mibps * MiB), base, args.timeout))
                    log(f"  {rows[-1]}")
            print(json.dumps(rows, indent=2) if args.json else critical_table(rows))
            return 0
        if args.mixed:
            big = push_images(reg, node.busybox_layer, 1, int(args.big_mib * MiB), "big")
            small = push_images(reg, node.busybox_layer, args.small_images, int(args.small_mib * MiB), "small")
            pods: Pods = [(0.0, [(f"big{n}", big[0].ref) for n in range(args.big_pods)]),
                          (args.gap, [(f"small{n}", small[n % len(small)].ref) for n in range(args.small_pods)])]
            shared = node.busybox_layer.blob.size
            sizes = [(big[0].image.size - shared, args.big_pods)] + [
                (img.image.size - shared, len(range(i, args.small_pods, len(small)))) for i, img in enumerate(small)]
            limit, best = best_order(sizes, shared, link_mibps * MiB)
            extra = (f"\nphysical limit (distinct bytes / link rate): {limit:.1f} s; "
                     f"p50 of the best order (most pods per byte first, one image at a time): {best:.1f} s")
            log(f"{args.big_pods} pods of a {big[0].image.size / MiB:.1f} MiB image, then {args.small_pods} pods over "
                f"{len(small)} images of {small[0].image.size / MiB:.1f} MiB, link {link_mibps:g} MiB/s")
        else:
            images = push_images(reg, node.busybox_layer, args.images, int(args.image_mib * MiB))
            pods = [(0.0, [(f"p{n}", images[n % len(images)].ref) for n in range(args.pods)])]
            log(f"{args.pods} pods over {args.images} images of {images[0].image.size / MiB:.1f} MiB, "
                f"link {link_mibps:g} MiB/s")
        for name in [n for _ in range(max(1, args.repeat)) for n in runs]:
            warn_load()
            log(f"run ({name}) {RUNS[name][0]} ...")
            rows.append(one_run(name, binaries, reg, node.pause.ref, pods, int(link_mibps * MiB), base, args.timeout))
            log(f"  {rows[-1]}")
    finally:
        reg.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(rows, indent=2) if args.json else table(rows) + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
