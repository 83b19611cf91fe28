"""End to end with containerd 2.x: a runtime handler the shim supplies reaches the
runtime, which pulls with that runtime's snapshotter.

containerd here has runtime ``fast`` with snapshotter overlayfs; its default
snapshotter is native, and runtime ``runc`` has no snapshotter of its own. For a
PullImage naming ``fast`` containerd 2.x logs ``experimental: PullImage "<ref>" for
runtime fast, using snapshotter overlayfs`` and unpacks into overlayfs, so what the
runtime received shows in its log and on disk. The shim runs as a process
(``shim_factory``); images come from the harness's registry (``make_image``).

containerd 1.6 (the harness's) does not read the field, so these tests need a
containerd 2.x binary (scripts/setup.sh installs it; the command is in
tests/support/containerd2.py). Without one they are skipped, or fail under CI.
"""

from __future__ import annotations

import os

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2 as pb
from tests.support import containerd2

pytestmark = pytest.mark.e2e

PULL = "/runtime.v1.ImageService/PullImage"


def request(image: str, namespace: str | None, handler: str = "") -> pb.PullImageRequest:
    req = pb.PullImageRequest(image=pb.ImageSpec(image=image, runtime_handler=handler))
    if namespace is not None:
        req.sandbox_config.metadata.CopyFrom(pb.PodSandboxMetadata(name="p", uid="uid-" + image.rsplit("/", 1)[-1],
                                                                   namespace=namespace))
    return req


async def pull(shim, req: pb.PullImageRequest) -> None:
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        resp = pb.PullImageResponse.FromString(await ch.unary_unary(PULL)(req.SerializeToString(), timeout=60))
    assert resp.image_ref.startswith("sha256:")


def runtime_used(c: containerd2.Containerd2, image: str) -> str | None:
    """What containerd logged choosing a runtime's snapshotter for ``image``, or None."""
    needle = f'experimental: PullImage \\"{image}\\" for runtime '
    for line in c.log().splitlines():
        if needle in line:
            return line.split(needle, 1)[1].split('"', 1)[0]
    return None


def snapshots(c: containerd2.Containerd2, snapshotter: str) -> int:
    d = c.dir / "root" / f"io.containerd.snapshotter.v1.{snapshotter}" / "snapshots"
    return len(os.listdir(d)) if d.exists() else 0


async def test_pull_lands_in_the_snapshotter_of_the_handler_a_rule_chose(ctrd2, shim_factory, make_image) -> None:
    shim = shim_factory({"runtime_handlers": {"rules": [{"handler": "fast", "namespaces": ["batch"]}]}},
                        upstream=ctrd2.socket)
    batch, web = make_image(), make_image()
    await pull(shim, request(batch.ref, "batch"))
    assert runtime_used(ctrd2, batch.ref) == "fast, using snapshotter overlayfs"
    assert snapshots(ctrd2, "overlayfs") > 0 and snapshots(ctrd2, "native") == 0
    await pull(shim, request(web.ref, "web"))  # no rule matches: the default snapshotter
    assert runtime_used(ctrd2, web.ref) is None
    assert snapshots(ctrd2, "native") > 0
    assert "runtime_handlers.rules[0]" in shim.log_text()


async def test_containerd_ignores_the_handler_without_sandbox_config(ctrd2, shim_factory, make_image) -> None:
    # The README's note: the shim injects the same handler both times, but with no
    # sandbox_config (as from `crictl pull` without --pod-config) containerd uses its
    # default snapshotter.
    shim = shim_factory({"runtime_handlers": {"rules": [{"handler": "fast"}]}}, upstream=ctrd2.socket)
    no_pod, with_pod = make_image(), make_image()
    await pull(shim, request(no_pod.ref, None))
    assert runtime_used(ctrd2, no_pod.ref) is None
    assert snapshots(ctrd2, "native") > 0 and snapshots(ctrd2, "overlayfs") == 0
    await pull(shim, request(with_pod.ref, "default"))
    assert runtime_used(ctrd2, with_pod.ref) == "fast, using snapshotter overlayfs"
    assert snapshots(ctrd2, "overlayfs") > 0


async def test_handler_sent_by_kubelet_is_kept(ctrd2, shim_factory, make_image) -> None:
    # kubelet (with its KEP-4216 gate on) names runc; the rule would say fast.
    shim = shim_factory({"runtime_handlers": {"rules": [{"handler": "fast"}]}}, upstream=ctrd2.socket)
    image = make_image()
    await pull(shim, request(image.ref, "default", handler="runc"))
    assert runtime_used(ctrd2, image.ref) is None
    assert snapshots(ctrd2, "native") > 0 and snapshots(ctrd2, "overlayfs") == 0
