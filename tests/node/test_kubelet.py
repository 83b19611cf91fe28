"""A real node: kubelet v1.35 (standalone, static pods) -> cri-shim -> containerd 2.x + runc.

What a node operator checks: pods from the registry reach Running, kubelet's own calls pass
through the shim, `crictl logs`/`exec` work through it, a pull storm from kubelet is collapsed
and capped, kubelet's image GC leaves pinned images alone, and image-only mode works as well as
full mode. Needs scripts/setup.d/30-node-runtime.sh and 40-kubelet.sh (skipped locally with the
install command when missing, failing under CI=true).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections import Counter

import pytest

from tests.support import prom
from tests.support.crictl import Crictl
from tests.support.node import (
    APPLETS,
    BUSYBOX,
    Kubelet,
    NodeContainerd,
    NodeImages,
    container_inspect,
    image_ids,
    ready_pods,
    rootfs_image,
    rootfs_layer,
    running_containers,
    short_dir,
    static_pod,
    wait_running,
)
from tests.support.registry import RegistryWithProxy
from tests.support.shim import ShimProcess

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"


def relayed_methods(shim: ShimProcess) -> set[str]:
    """Methods the shim relayed untouched (its debug log names each one)."""
    return set(re.findall(r'msg=relayed method=(\S+)', shim.logs()))


async def intercepted_methods(shim: ShimProcess) -> set[str]:
    """Methods the shim answered itself with OK (cri_shim_rpc_duration_seconds{method,code})."""
    scrape = await prom.scrape(shim.metrics_address)  # type: ignore[attr-defined]
    return {f"{IMAGE if 'Image' in dict(labels)['method'] else RUNTIME}{dict(labels)['method']}"
            for (name, labels), value in scrape.samples.items()
            if name == "cri_shim_rpc_duration_seconds_count" and value > 0 and dict(labels).get("code") == "OK"}


async def wait_methods(shim: ShimProcess, expected: set[str], timeout: float = 30.0) -> set[str]:
    """Every method seen through the shim, once ``expected`` are all among them (kubelet makes
    some calls on timers: PLEG every second, stats and eviction every 10 s)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = relayed_methods(shim) | await intercepted_methods(shim)
        if expected <= seen or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.5)


def why(*sources: object) -> object:
    def tails() -> str:
        return "\n".join(f"--- {type(s).__name__} log:\n{s.log_tail()}" for s in sources)  # type: ignore[attr-defined]
    return tails


@pytest.mark.parametrize("mode", ["full", "image-only", "full-evented-pleg"])
async def test_kubelet_runs_static_pods_through_the_shim(
        mode: str, node_containerd: NodeContainerd, node_images: NodeImages, registry: RegistryWithProxy,
        node_shim, kubelet_factory) -> None:
    assert registry.proxy is not None
    registry.proxy.reset()
    shim = await node_shim()
    runtime_endpoint = node_containerd.endpoint if mode == "image-only" else shim.endpoint
    # EventedPLEG (off by default in 1.35) makes kubelet follow GetContainerEvents, a server stream.
    config = {"featureGates": {"EventedPLEG": True}} if mode == "full-evented-pleg" else {}
    kubelet: Kubelet = kubelet_factory(runtime_endpoint=runtime_endpoint, image_endpoint=shim.endpoint,
                                       config=config)
    kubelet.add_static_pod(static_pod("web", node_images.busybox.ref,
                                      ["sh", "-c", "echo hello from web; exec sleep 3600"]))
    direct = Crictl(node_containerd.endpoint, timeout=60)
    via_shim = Crictl(shim.endpoint, timeout=60)
    pod = kubelet.pod_name("web")

    running = await asyncio.to_thread(wait_running, direct, {pod}, timeout=180, why=why(kubelet, node_containerd))
    cid = running[pod]["id"]
    image_calls = {IMAGE + m for m in ("ImageFsInfo", "ListImages", "ImageStatus", "PullImage")}
    runtime_calls = {RUNTIME + m for m in ("Version", "Status", "ListPodSandbox", "ListContainers",
                                           "RunPodSandbox", "CreateContainer", "StartContainer",
                                           "PodSandboxStatus", "RuntimeConfig")}
    if mode == "full-evented-pleg":
        runtime_calls.add(RUNTIME + "GetContainerEvents")
    # kubelet's calls, before crictl adds its own through the shim
    seen = await wait_methods(shim, image_calls | (runtime_calls if mode != "image-only" else set()))

    # The same pod and container, Running, whichever socket crictl asks.
    assert running_containers(via_shim)[pod]["id"] == cid
    assert pod in ready_pods(via_shim) and pod in ready_pods(direct)
    assert running[pod]["imageRef"] == node_images.busybox.image_id
    assert container_inspect(via_shim, cid)["status"]["state"] == "CONTAINER_RUNNING"
    # The image came from the registry, pulled through the shim.
    assert registry.stats().manifest_requests_for("node/busybox", "1") >= 1
    assert registry.stats().manifest_requests_for("node/pause", "1") >= 1  # containerd's own pull
    assert IMAGE + "PullImage" in seen, sorted(seen)

    # kubelet's own calls reached containerd through the shim.
    assert image_calls <= seen, f"missing: {sorted(image_calls - seen)}; seen: {sorted(seen)}"
    if mode != "image-only":
        assert runtime_calls <= seen, f"missing: {sorted(runtime_calls - seen)}; seen: {sorted(seen)}"
    else:
        # image-only: kubelet talks to containerd for everything else
        assert not {m for m in seen if m.startswith(RUNTIME)}, sorted(seen)

    # crictl logs and exec, through the shim
    logs = via_shim.run("logs", cid)
    assert logs.returncode == 0 and "hello from web" in logs.stdout, logs
    out = via_shim.run("exec", cid, "hostname")
    assert out.returncode == 0, out
    assert out.stdout.strip() == pod
    out = via_shim.run("exec", cid, "sh", "-c", "echo $((6*7)) from $(id -u)")
    assert out.returncode == 0 and out.stdout.strip() == "42 from 0", out
    now = relayed_methods(shim) | await intercepted_methods(shim)
    assert {RUNTIME + "Exec", RUNTIME + "ExecSync"} & now, sorted(now)  # crictl exec streams (Exec) by default
    assert kubelet.running, kubelet.log_tail()


STORM_IMAGES = 4
STORM_PODS = 24
STORM_MAX_PARALLEL = 2


async def test_pull_storm_from_kubelet_is_collapsed_and_capped(
        node_containerd: NodeContainerd, node_images: NodeImages, registry: RegistryWithProxy,
        node_shim, kubelet_factory) -> None:
    # Each image has a layer of its own (busybox plus 1 MiB of random bytes), so every image
    # really downloads; the proxy serves blob bodies at 2 MiB/s per connection so pulls overlap.
    images = [registry.push(rootfs_image([rootfs_layer({"bin/busybox": (BUSYBOX.read_bytes(), 0o755),
                                                         "filler.bin": (os.urandom(1 << 20), 0o644)},
                                                        {f"bin/{a}": "busybox" for a in APPLETS})],
                                         cmd=["sleep", "3600"], unique=f"storm-{i}-{os.getpid()}"),
                            f"node/storm{i}", "1") for i in range(STORM_IMAGES)]
    direct = Crictl(node_containerd.endpoint, timeout=60)
    assert direct.pull(node_images.pause.ref).returncode == 0  # the sandbox image is containerd's own pull
    shim = await node_shim({"pulls": {"max_parallel": STORM_MAX_PARALLEL, "dedup": True}})
    kubelet: Kubelet = kubelet_factory(runtime_endpoint=shim.endpoint, image_endpoint=shim.endpoint)
    kubelet.wait_healthy()
    assert registry.proxy is not None
    registry.proxy.reset()
    registry.proxy.set_throttle(2 << 20)
    pods = {kubelet.pod_name(f"storm{n}") for n in range(STORM_PODS)}
    for n in range(STORM_PODS):  # all manifests land within a few milliseconds
        kubelet.add_static_pod(static_pod(f"storm{n}", images[n % STORM_IMAGES].ref))

    await asyncio.to_thread(wait_running, direct, pods, timeout=240, why=why(kubelet, node_containerd))

    stats = registry.stats()
    records = registry.proxy.records()
    resolves = Counter(r.image for r in records if r.kind == "manifest" and r.method == "HEAD")
    for image in images:
        key = (image.repository, image.tag)
        # one resolve (HEAD by tag) and one manifest fetch per image, however many pods use it
        assert resolves[key] == 1, (key, resolves)
        assert stats.manifest_requests_for(*key) <= 2, (key, stats.manifests_by_image)
    assert stats.max_concurrent_images <= STORM_MAX_PARALLEL, stats
    scrape = await prom.scrape(shim.metrics_address)  # type: ignore[attr-defined]
    upstream_pulls = scrape.value("cri_shim_pulls_total", result="success")
    requests = sum(v for (name, _), v in scrape.samples.items() if name == "cri_shim_pull_requests_total")
    print(f"storm: {STORM_PODS} pods over {STORM_IMAGES} images: kubelet PullImage calls={requests:g}, "
          f"upstream pulls={upstream_pulls:g}, joined={scrape.value('cri_shim_pull_dedup_joins_total'):g}, "
          f"resolves per image={dict(resolves)}, "
          f"max images downloading at once={stats.max_concurrent_images}, blob GETs={stats.blob_requests}")
    assert upstream_pulls == STORM_IMAGES
    assert len(running_containers(Crictl(shim.endpoint, timeout=60)).keys() & pods) == STORM_PODS


async def test_kubelet_image_gc_leaves_pinned_images(
        node_containerd: NodeContainerd, node_images: NodeImages, registry: RegistryWithProxy,
        node_shim, kubelet_factory) -> None:
    pinned = node_images.variant(registry, "node/gc-pinned")
    unpinned = node_images.variant(registry, "node/gc-unpinned")
    shim = await node_shim({"pins": {"images": [f"{pinned.repo_ref}:*"]}})
    via_shim = Crictl(shim.endpoint, timeout=60)
    for image in (pinned, unpinned, node_images.busybox):
        res = via_shim.pull(image.ref)
        assert res.returncode == 0, res
    # Any disk usage is above 1%: every image GC pass wants to free everything it may. The
    # periodic pass runs at start (when every image is "younger" than the pass: nothing is
    # eligible) and then every 5 minutes; a hard eviction threshold below the disk's real free
    # space makes the eviction manager run the same image GC (DeleteUnusedImages) every 10 s.
    # Static pods are critical: never evicted. imageMinimumGCAge 0 would mean the default 2m.
    kubelet: Kubelet = kubelet_factory(
        runtime_endpoint=shim.endpoint, image_endpoint=shim.endpoint,
        config={"imageGCHighThresholdPercent": 1, "imageGCLowThresholdPercent": 0, "imageMinimumGCAge": "1s",
                "evictionHard": {"memory.available": "1Mi", "nodefs.available": "99%", "imagefs.available": "99%"}},
        args=["--vmodule=image_gc_manager=5"])
    kubelet.add_static_pod(static_pod("keeper", node_images.busybox.ref))
    pod = kubelet.pod_name("keeper")
    running = await asyncio.to_thread(wait_running, via_shim, {pod}, timeout=120, why=why(kubelet, node_containerd))

    def gc_done() -> dict[str, dict]:
        deadline = time.monotonic() + 120
        while True:
            images = image_ids(via_shim)
            if unpinned.image_id not in images:
                return images
            if time.monotonic() > deadline:
                raise AssertionError(f"kubelet never removed the unpinned image:\n{kubelet.log_tail()}")
            time.sleep(0.5)

    images = await asyncio.to_thread(gc_done)
    assert pinned.image_id in images and images[pinned.image_id]["pinned"] is True
    assert node_images.busybox.image_id in images  # in use by the running pod
    after = running_containers(via_shim)
    assert after[pod]["id"] == running[pod]["id"]
    assert after[pod]["annotations"]["io.kubernetes.container.restartCount"] == "0"
    # kubelet reads `pinned: true` from ListImages (the shim adds it) and never asks to remove the
    # pinned image; it says so only at -v=5. The unpinned one it removes, logging at -v=0.
    log = kubelet.log()
    assert f'"Image is pinned, skipping garbage collection" imageID="{pinned.image_id}"' in log
    assert f'"Removing image to free bytes" imageID="{unpinned.image_id}"' in log
    scrape = await prom.scrape(shim.metrics_address)  # type: ignore[attr-defined]
    assert scrape.value("cri_shim_remove_denied_total") == 0  # no refusal was needed
    print("kubelet image GC log:\n" + "\n".join(line for line in log.splitlines()
                                                 if "Image is pinned" in line or "Removing image" in line))
    # What an operator (or anything else) sees when removing a pinned image by hand:
    res = via_shim.rmi(pinned.ref)
    assert res.returncode != 0 and "is pinned by pins.images entry" in res.stderr, res
    print("crictl rmi of a pinned image:", res.stderr.strip())
    assert pinned.image_id in image_ids(via_shim)
    scrape = await prom.scrape(shim.metrics_address)  # type: ignore[attr-defined]
    assert scrape.value("cri_shim_remove_denied_total") == 1


async def test_shim_restart_under_a_running_kubelet(
        node_containerd: NodeContainerd, node_images: NodeImages, registry: RegistryWithProxy,
        node_shim, kubelet_factory) -> None:
    sock_dir = short_dir("nodes-")
    try:
        listen = str(sock_dir / "cri-shim.sock")
        shim = await node_shim(listen_path=listen)
        kubelet: Kubelet = kubelet_factory(runtime_endpoint=shim.endpoint, image_endpoint=shim.endpoint)
        kubelet.add_static_pod(static_pod("steady", node_images.busybox.ref))
        direct = Crictl(node_containerd.endpoint, timeout=60)
        steady = kubelet.pod_name("steady")
        before = (await asyncio.to_thread(wait_running, direct, {steady}, timeout=120,
                                          why=why(kubelet, node_containerd)))[steady]

        offset = len(kubelet.log())
        shim.terminate()  # what `systemctl restart cri-shim` does first
        assert await shim.await_exit(30) == 0

        def kubelet_noticed() -> str:
            deadline = time.monotonic() + 30
            while "code = Unavailable" not in (tail := kubelet.log()[offset:]):
                if time.monotonic() > deadline:
                    raise AssertionError(f"kubelet never saw the shim gone:\n{tail[-3000:]}")
                time.sleep(0.2)
            return next(line for line in tail.splitlines() if "code = Unavailable" in line)

        print("kubelet while the shim is down:", await asyncio.to_thread(kubelet_noticed))
        again = await node_shim(listen_path=listen)
        # kubelet reconnects by itself (its gRPC backoff is capped at 3 s): its PLEG relists arrive.
        await again.await_log("msg=relayed method=/runtime.v1.RuntimeService/ListPodSandbox", timeout=30)

        kubelet.add_static_pod(static_pod("after", node_images.busybox.ref))
        after = kubelet.pod_name("after")
        now = await asyncio.to_thread(wait_running, Crictl(again.endpoint, timeout=60), {steady, after},
                                      timeout=120, why=why(kubelet, node_containerd))
        # The pod that ran across the restart: same container, same sandbox, never restarted.
        assert now[steady]["id"] == before["id"]
        assert now[steady]["podSandboxId"] == before["podSandboxId"]
        assert now[steady]["metadata"]["attempt"] == 0
        assert now[steady]["annotations"]["io.kubernetes.container.restartCount"] == "0"
        sandboxes = [p for p in ready_pods(direct).values() if p["metadata"]["name"] == steady]
        assert len(sandboxes) == 1
        assert kubelet.running
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
