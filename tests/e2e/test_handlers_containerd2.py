"""End to end with containerd 2.x: a runtime handler the shim supplies reaches the
runtime, which then pulls with that runtime's snapshotter.

containerd 2.x logs ``experimental: PullImage "<ref>" for runtime <handler>, using
snapshotter <name>`` when a PullImage names a configured runtime whose snapshotter
differs from the default, before it contacts the registry. The pulls here go to a
registry that is not there (127.0.0.1:1), so they fail after that point; what
matters is which handler containerd acted on. Skipped when no containerd 2.x binary
is installed (see tests/support/containerd2.py for the install command).
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2 as pb
from tests.support import containerd2
from tests.support.inproc import running_shim

pytestmark = pytest.mark.e2e

PULL = "/runtime.v1.ImageService/PullImage"
_n = itertools.count()


@pytest.fixture
def ctrd2(tmp_path):
    binary, why = containerd2.find()
    if binary is None:
        pytest.skip(why)
    c = containerd2.Containerd2(binary, tmp_path / "c2", {"fast": "overlayfs"}).start()
    yield c
    c.stop()


def ref() -> str:
    return f"127.0.0.1:1/cri-shim-test/handlers{next(_n)}:1"


def used_snapshotter(c: containerd2.Containerd2, image: str) -> str | None:
    """The runtime/snapshotter containerd logged for a pull of ``image``, or None."""
    needle = f'experimental: PullImage \\"{image}\\" for runtime '
    for line in c.log().splitlines():
        if needle in line:
            return line.split(needle, 1)[1].split('"', 1)[0]
    return None


async def pull(shim_endpoint: str, req: pb.PullImageRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(shim_endpoint) as ch:
        try:
            await ch.unary_unary(PULL)(req.SerializeToString(), timeout=20)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def request(image: str, namespace: str | None, handler: str = "") -> pb.PullImageRequest:
    req = pb.PullImageRequest(image=pb.ImageSpec(image=image, runtime_handler=handler))
    if namespace is not None:
        req.sandbox_config.metadata.CopyFrom(pb.PodSandboxMetadata(name="p", uid="uid-" + image[-3:],
                                                                   namespace=namespace))
    return req


async def test_containerd2_pulls_with_the_handler_the_shim_injected(ctrd2) -> None:
    settings = {"runtime_handlers": {"rules": [{"handler": "fast", "namespaces": ["batch"]}]}}
    injected, other_ns = ref(), ref()
    async with running_shim(ctrd2.endpoint, settings) as shim:
        # the pulls fail (no registry); the snapshotter choice was made before that
        assert await pull(shim.endpoint, request(injected, "batch")) is grpc.StatusCode.UNKNOWN
        assert await pull(shim.endpoint, request(other_ns, "web")) is grpc.StatusCode.UNKNOWN
    await asyncio.sleep(0.2)  # let containerd flush its log
    assert used_snapshotter(ctrd2, injected) == "fast, using snapshotter overlayfs"
    assert used_snapshotter(ctrd2, other_ns) is None  # no rule matched: default snapshotter


async def test_containerd2_ignores_the_handler_without_sandbox_config(ctrd2) -> None:
    # What the README's note says: the same handler, but no sandbox_config (as from
    # `crictl pull` without a pod config), and containerd uses its default snapshotter.
    settings = {"runtime_handlers": {"rules": [{"handler": "fast", "images": ["127.0.0.1:1/cri-shim-test/*"]}]}}
    with_pod, without_pod = ref(), ref()
    async with running_shim(ctrd2.endpoint, settings) as shim:
        await pull(shim.endpoint, request(with_pod, "default"))
        await pull(shim.endpoint, request(without_pod, None))
    await asyncio.sleep(0.2)
    assert used_snapshotter(ctrd2, with_pod) == "fast, using snapshotter overlayfs"
    assert used_snapshotter(ctrd2, without_pod) is None
