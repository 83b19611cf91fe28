"""Image-only mode against real containerd, as a node runs it: kubelet's
imageServiceEndpoint is the shim, its containerRuntimeEndpoint is containerd.

crictl stands in for kubelet (`-r containerd -i shim`): pulls go through the shim (its
cap holds, its log sees them), RuntimeService calls go straight to containerd, so they
keep working while the shim is stopped, and image calls come back when it restarts."""

from __future__ import annotations

import threading

import pytest

from tests.support.containerd import Containerd
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e

SETTINGS = {"pulls": {"max_parallel": 1}, "server": {"admin_socket": ""}}


def test_image_only_mode_pulls_through_shim_runtime_calls_direct(
        shim_factory, containerd: Containerd, crictl_factory, make_image, proxy: CountingProxy) -> None:
    shim = shim_factory(SETTINGS)
    kubelet = crictl_factory(containerd.socket, shim.socket)  # -r containerd -i shim

    # Two pulls at once; the shim lets one reach the registry at a time.
    images = [make_image(filler_bytes=150_000) for _ in range(2)]
    proxy.set_throttle(300_000)  # ~0.5 s per image, so unserialized pulls would overlap
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i.ref, kubelet.pull(i.ref, timeout=60)))
               for i in images]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    proxy.set_throttle(None)
    for img in images:
        out = results[img.ref]
        assert out.returncode == 0, out.stderr  # type: ignore[attr-defined]
        assert img.image_id in out.stdout  # type: ignore[attr-defined]
        assert img.ref in shim.log_text()  # the shim saw (and scheduled) the pull
    assert proxy.stats().max_concurrent_images == 1

    listed = kubelet.images("-q")
    assert listed.returncode == 0 and all(i.image_id in listed.stdout for i in images)

    # RuntimeService calls do not touch the shim: they work with the shim stopped.
    assert shim.stop() == 0
    # (Not `crictl ps`: crictl itself asks the image service for image names there; kubelet does not.)
    for args in (("version",), ("pods", "-q"), ("info",), ("stats", "-a")):
        out = kubelet.run(*args)
        assert out.returncode == 0, (args, out.stderr)
    assert "containerd" in kubelet.run("version").stdout
    # ... while image calls, which need the shim, fail until it is back.
    down = kubelet.images("-q")
    assert down.returncode != 0
    shim.start()
    back = kubelet.images("-q")
    assert back.returncode == 0 and all(i.image_id in back.stdout for i in images)


def test_full_mode_everything_through_shim(shim_factory, containerd: Containerd, crictl_factory,
                                           make_image) -> None:
    """The other mode, for contrast: with the shim stopped nothing answers."""
    shim = shim_factory(SETTINGS)
    kubelet = crictl_factory(shim.socket)  # -r shim (-i defaults to -r)
    img = make_image()
    out = kubelet.pull(img.ref)
    assert out.returncode == 0, out.stderr
    assert img.ref in shim.log_text()
    version = kubelet.run("version")
    assert version.returncode == 0 and "containerd" in version.stdout
    assert shim.stop() == 0
    assert kubelet.run("version", timeout=5).returncode != 0
