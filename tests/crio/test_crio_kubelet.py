"""A real node with CRI-O as the runtime: kubelet v1.35 (standalone, static pods) -> cri-shim
(its own process) -> CRI-O v1.34 running containers with runc.

What a node operator on a CRI-O node (OpenShift) checks: a static pod whose image is only in the
local registry reaches Running, its image was pulled through the shim (the shim counted kubelet's
PullImage), and an image pinned in the shim shows ``pinned`` to crictl, in full mode (kubelet's
runtime and image endpoints are the shim) and in image-only mode (only kubelet's image endpoint
is the shim; the runtime endpoint is CRI-O's socket).

CRI-O here has no CNI plugins, so the pods use the host network; its pause image is the node
suite's pause image from the local registry. Needs scripts/setup.d/50-crio.sh (CRI-O), and
30-node-runtime.sh and 40-kubelet.sh (kubelet, test images): skipped locally with the install
command when missing, failing under CI=true.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import prom
from tests.support.crictl import Crictl
from tests.support.crio import Crio
from tests.support.fixtures import ShimFactory
from tests.support.node import (  # noqa: F401  (fixtures)
    APPLETS,
    BUSYBOX,
    Kubelet,
    NodeImages,
    container_inspect,
    image_ids,
    kubelet_factory,
    node_binaries,
    node_images,
    rootfs_image,
    rootfs_layer,
    static_pod,
    wait_running,
)
from tests.support.registry import RegistryWithProxy

pytestmark = [pytest.mark.crio, pytest.mark.node]


@pytest.fixture
def node_crio(crio_factory, node_images: NodeImages) -> Iterator[Crio]:
    """A private CRI-O whose pause image is the node suite's; every pod it runs (kubelet's pods
    outlive kubelet, as on a real node) is removed before it stops, and its mounts with it."""
    c: Crio = crio_factory(pause_image=node_images.pause.ref)
    try:
        yield c
    finally:
        if c.running:
            direct = Crictl(c.endpoint, timeout=60)
            # SIGKILL first: CRI-O's StopPodSandbox gives a container that ignores SIGTERM
            # (`sleep` as PID 1) about a minute.
            ids = direct.run("ps", "-a", "-q").stdout.split()
            if ids:
                direct.run("stop", "--timeout", "0", *ids, timeout=60)
            direct.run("rmp", "--all", "--force", timeout=60)
        c.stop()
        subprocess.run(["umount", "-R", "-l", str(c.workdir)], capture_output=True, check=False)


@pytest.fixture
def crio_shim(node_crio: Crio, tmp_path: Path) -> Iterator[ShimFactory]:
    """Shims in front of ``node_crio``."""
    factory = ShimFactory(lambda: str(node_crio.socket), tmp_path)
    yield factory
    factory.close()


def host_network_pod(name: str, image: str) -> dict[str, Any]:
    pod = static_pod(name, image, ["sh", "-c", "echo hello from crio; exec sleep 3600"])
    pod["spec"]["hostNetwork"] = True  # no CNI plugins with this CRI-O
    return pod


@pytest.mark.parametrize("mode", ["full", "image-only"])
async def test_kubelet_runs_a_static_pod_on_crio_through_the_shim(
        mode: str, node_crio: Crio, node_images: NodeImages, registry: RegistryWithProxy, crio_shim: ShimFactory,
        kubelet_factory) -> None:
    image = node_images.variant(registry, f"node/crio-{mode}")  # only in the local registry
    metrics = f"127.0.0.1:{prom.free_port()}"
    shim = crio_shim({"server": {"admin_socket": ""}, "metrics": {"address": metrics},
                      "pins": {"images": [image.ref]}})
    runtime_endpoint = node_crio.endpoint if mode == "image-only" else shim.endpoint
    kubelet: Kubelet = kubelet_factory(runtime_endpoint=runtime_endpoint, image_endpoint=shim.endpoint)
    kubelet.add_static_pod(host_network_pod("web", image.ref))
    via_shim = Crictl(shim.endpoint, timeout=60)
    pod = kubelet.pod_name("web")

    def why() -> str:
        return (f"--- kubelet:\n{kubelet.log_tail()}\n--- CRI-O:\n{node_crio.log_tail()}"
                f"\n--- shim:\n{shim.log_tail()}")

    running = await asyncio.to_thread(wait_running, via_shim, {pod}, timeout=120, why=why)
    cid = running[pod]["id"]
    assert container_inspect(via_shim, cid)["status"]["state"] == "CONTAINER_RUNNING"
    bare_id = image.image_id.removeprefix("sha256:")  # CRI-O's image IDs have no sha256: prefix
    assert running[pod]["imageRef"] == image.digest_ref  # CRI-O reports the repo digest here
    logs = via_shim.run("logs", cid)
    assert logs.returncode == 0 and "hello from crio" in logs.stdout, logs

    # kubelet's PullImage went through the shim, which pulled from the registry.
    scrape = await prom.scrape(metrics)
    requests = sum(v for (name, _), v in scrape.samples.items() if name == "cri_shim_pull_requests_total")
    assert requests >= 1, scrape.text
    assert f"msg=\"pull done\" image={image.ref} " in shim.log_text()
    assert registry.stats().manifest_requests_for(image.repository, image.tag) >= 1

    # The shim's pin shows: crictl through the shim says pinned, CRI-O alone does not.
    assert image_ids(via_shim)[bare_id]["pinned"] is True
    assert image_ids(Crictl(node_crio.endpoint, timeout=60))[bare_id]["pinned"] is False
    res = via_shim.rmi(image.ref)
    assert res.returncode != 0 and "is pinned by" in res.stderr, res
    # Who ran the container: through the shim in full mode, CRI-O directly in image-only mode.
    created = "msg=relayed method=/runtime.v1.RuntimeService/CreateContainer" in shim.log_text()
    assert created is (mode == "full"), mode
    assert kubelet.running, kubelet.log_tail()


async def test_hung_registries_do_not_keep_a_healthy_pod_from_running_on_crio(
        node_crio: Crio, node_images: NodeImages, registry: RegistryWithProxy, crio_shim: ShimFactory,
        kubelet_factory) -> None:
    """CRI-O shows the shim no pull progress, so nothing can tell these two hung pulls (a manifest
    never answered, a blob stopped mid-way) from slow ones. They fill ``max_parallel: 2``; after
    the no-progress timeout they go on without their slots, and a healthy pod added behind them
    reaches Running (tests/node/test_kubelet_wedge.py is the same on containerd, where the
    hung pulls are ended)."""
    no_progress = 6
    proxy = registry.proxy
    assert proxy is not None
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    hung_manifest = node_images.variant(registry, f"node/crio-hang-manifest-{suffix}")
    hung_blob = node_images.with_filler(registry, f"node/crio-hang-blob-{suffix}", 4)
    healthy_image = node_images.variant(registry, f"node/crio-healthy-{suffix}")
    proxy.hang(hung_manifest.repository, manifest=True)
    proxy.hang(hung_blob.repository, blob_after=3 << 19)  # 1.5 MiB, then nothing
    try:
        shim = crio_shim({"pulls": {"max_parallel": 2, "no_progress_timeout_seconds": no_progress}})
        kubelet: Kubelet = kubelet_factory(runtime_endpoint=shim.endpoint, image_endpoint=shim.endpoint)
        kubelet.wait_healthy()
        kubelet.add_static_pod(host_network_pod("hung-manifest", hung_manifest.ref))
        kubelet.add_static_pod(host_network_pod("hung-blob", hung_blob.ref))
        await asyncio.to_thread(proxy.wait_until, lambda s: s.manifest_requests_for(
            hung_manifest.repository, hung_manifest.tag) > 0 and s.inflight_blob_gets > 0, 60)
        t0 = time.monotonic()
        kubelet.add_static_pod(host_network_pod("healthy", healthy_image.ref))
        healthy = kubelet.pod_name("healthy")
        via_shim = Crictl(shim.endpoint, timeout=60)

        def why() -> str:
            return f"--- kubelet:\n{kubelet.log_tail()}\n--- shim:\n{shim.log_tail()}"

        await asyncio.to_thread(wait_running, via_shim, {healthy}, timeout=120, why=why)
        took = time.monotonic() - t0
        released = shim.log_text().count("it goes on without a pull slot")
        print(f"\nCRI-O: healthy pod Running {took:.1f} s after it was added behind 2 hung pulls "
              f"(no-progress timeout {no_progress} s); pulls that gave back their slot: {released}")
        assert released >= 1, shim.log_tail()
        assert "made no progress" not in shim.log_text()  # nothing judged, nothing ended
        assert took < 90
    finally:
        proxy.unhang()
