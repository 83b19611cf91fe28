"""End to end with containerd 2.x: a runtime handler the shim supplies reaches the
runtime, which then pulls with that runtime's snapshotter.

containerd here has runtime ``fast`` with snapshotter overlayfs; its default is
native. containerd 2.x logs ``experimental: PullImage "<ref>" for runtime <handler>,
using snapshotter <name>`` when a PullImage names such a runtime, before it contacts
the registry, so most pulls here go to a registry that is not there (127.0.0.1:1)
and fail after that point. One test pulls a real (tiny, fabricated) image from a
static in-process registry and finds it unpacked in the overlayfs snapshotter.
Skipped when no containerd 2.x binary is installed (see tests/support/containerd2.py
for the install command).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import http.server
import io
import itertools
import json
import os
import tarfile
import threading

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


async def pull(shim_endpoint: str, req: pb.PullImageRequest) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(shim_endpoint) as ch:
        try:
            await ch.unary_unary(PULL)(req.SerializeToString(), timeout=20)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


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
        assert (await pull(shim.endpoint, request(injected, "batch")))[0] is grpc.StatusCode.UNKNOWN
        assert (await pull(shim.endpoint, request(other_ns, "web")))[0] is grpc.StatusCode.UNKNOWN
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


# --------------------------------------------------------------------------- a real pull


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tiny_image() -> tuple[bytes, dict[str, bytes]]:
    """(manifest, blobs by digest) of a one-file OCI image for this machine's platform."""
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        data = b"cri-shim runtime handler test\n"
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mtime = len(data), 0
        t.addfile(info, io.BytesIO(data))
    layer = gzip.compress(tar.getvalue(), mtime=0)
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    config = json.dumps({"architecture": arch, "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(tar.getvalue())]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _digest(layer),
                    "size": len(layer)}],
    }).encode()
    return manifest, {_digest(config): config, _digest(layer): layer}


@pytest.fixture
def static_registry():
    """A read-only registry v2 on loopback serving tiny_image() under any name and tag."""
    manifest, blobs = tiny_image()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            path = self.path.split("?")[0]
            if path in ("/v2", "/v2/"):
                data, ctype = b"{}", "application/json"
            elif "/manifests/" in path:
                data, ctype = manifest, "application/vnd.oci.image.manifest.v1+json"
            elif "/blobs/" in path and path.rsplit("/", 1)[1] in blobs:
                data, ctype = blobs[path.rsplit("/", 1)[1]], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Docker-Content-Digest", _digest(data))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(False)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def snapshots(c: containerd2.Containerd2, snapshotter: str) -> list[str]:
    d = c.dir / "root" / f"io.containerd.snapshotter.v1.{snapshotter}" / "snapshots"
    return os.listdir(d) if d.exists() else []


async def test_containerd2_unpacks_into_the_snapshotter_of_the_injected_handler(ctrd2, static_registry) -> None:
    host = static_registry
    (ctrd2.dir / "certs.d" / host).mkdir(parents=True)
    (ctrd2.dir / "certs.d" / host / "hosts.toml").write_text(
        f'server = "http://{host}"\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n')
    settings = {"runtime_handlers": {"rules": [{"handler": "fast", "namespaces": ["batch"]}]}}
    async with running_shim(ctrd2.endpoint, settings) as shim:
        assert await pull(shim.endpoint, request(f"{host}/test/app:1", "batch")) == (grpc.StatusCode.OK, "")
        assert snapshots(ctrd2, "overlayfs") and not snapshots(ctrd2, "native")
        # the same image for a pod no rule matches: the default snapshotter
        assert await pull(shim.endpoint, request(f"{host}/test/app:2", "web")) == (grpc.StatusCode.OK, "")
        assert snapshots(ctrd2, "native")
