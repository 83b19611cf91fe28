"""A real kubelet behind the shim with two hung registries filling `pulls.max_parallel: 2`.

kubelet sets no deadline on PullImage. One pod's registry never answers the manifest, another's
blob stops mid-way; both hold a slot. The no-progress guard ends them (kubelet logs the shim's
message and retries after its back-off), and a healthy pod added after them reaches Running.
"""

from __future__ import annotations

import asyncio
import os
import time

from tests.support.crictl import Crictl
from tests.support.node import (
    Kubelet,
    NodeContainerd,
    NodeImages,
    static_pod,
    wait_running,
)
from tests.support.registry import RegistryWithProxy

NO_PROGRESS = 6


async def test_hung_registries_do_not_keep_a_healthy_pod_from_running(
        node_containerd: NodeContainerd, node_images: NodeImages, registry: RegistryWithProxy,
        node_shim, kubelet_factory) -> None:
    proxy = registry.proxy
    assert proxy is not None
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    hung_manifest = node_images.variant(registry, f"node/hang-manifest-{suffix}")
    hung_blob = node_images.with_filler(registry, f"node/hang-blob-{suffix}", 4)
    direct = Crictl(node_containerd.endpoint, timeout=60)
    assert direct.pull(node_images.pause.ref).returncode == 0  # the sandbox image is containerd's own pull
    proxy.hang(hung_manifest.repository, manifest=True)
    proxy.hang(hung_blob.repository, blob_after=3 << 19)  # 1.5 MiB, then nothing
    shim = await node_shim({"pulls": {"max_parallel": 2, "progress_interval_seconds": 0.5,
                                      "no_progress_timeout_seconds": NO_PROGRESS}})
    kubelet: Kubelet = kubelet_factory(runtime_endpoint=shim.endpoint, image_endpoint=shim.endpoint)
    kubelet.wait_healthy()
    kubelet.add_static_pod(static_pod("hung-manifest", hung_manifest.ref))
    kubelet.add_static_pod(static_pod("hung-blob", hung_blob.ref))
    await asyncio.to_thread(proxy.wait_until, lambda s: s.manifest_requests_for(hung_manifest.repository, hung_manifest.tag) > 0
                            and s.inflight_blob_gets > 0, 60)
    t0 = time.monotonic()
    kubelet.add_static_pod(static_pod("healthy", node_images.busybox.ref))
    healthy = kubelet.pod_name("healthy")
    await asyncio.to_thread(wait_running, direct, {healthy}, timeout=120, why=kubelet.log_tail)
    took = time.monotonic() - t0
    # The healthy pod needs only one freed slot: the other hung pull may be ended a little later
    # (its last bytes arrived after t0). Each hung caller must still be told, within the guard's time.
    expected = [f"cri-shim: pull of {hung_manifest.ref} made no progress for {NO_PROGRESS} s (resolving the manifest",
                f"cri-shim: pull of {hung_blob.ref} made no progress for {NO_PROGRESS} s (downloading: "]
    deadline = time.monotonic() + 4 * NO_PROGRESS
    while not all(e in kubelet.log() for e in expected) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    log = kubelet.log()
    told = [next((line for line in log.splitlines() if e in line), f"(not told: {e})") for e in expected]
    print(f"\nhealthy pod Running {took:.1f} s after it was added behind 2 hung pulls "
          f"(no-progress timeout {NO_PROGRESS} s); kubelet was told:\n" + "\n".join(told))
    for e in expected:
        assert e in log, f"kubelet was not told {e!r} within {4 * NO_PROGRESS} s; shim log:\n{shim.logs()[-6000:]}"
    assert "code = Unavailable" in log
    assert took < 90
