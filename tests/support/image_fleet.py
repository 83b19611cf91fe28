"""Many small images, fast: pushed to the test registry and pulled straight into containerd.

Every image shares one tiny layer and differs by its config, so a push is a config
and a manifest and a pull downloads two small blobs. Pulls go to containerd over CRI
directly (not through the shim), many at a time on one channel.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import grpc

from . import cri, oci
from .oci import PushedImage
from .registry import RegistryWithProxy

PULL = "/runtime.v1.ImageService/PullImage"


def push_fleet(registry: RegistryWithProxy, prefix: str, count: int, *, start: int = 0,
               per_repo: int = 100) -> list[PushedImage]:
    """Push ``count`` images named ``<prefix>/r<k>:v<i>`` (``per_repo`` tags per repository)."""
    shared = oci.make_layer({"fleet.txt": prefix.encode()})
    items = [(oci.make_image([shared], unique=f"{prefix}-{i}"), f"{prefix}/r{i // per_repo}", f"v{i}")
             for i in range(start, start + count)]
    # the shared layer into every repository first, one at a time: concurrent first pushes
    # into a new repository can get a 500 from docker-registry
    for repo in dict.fromkeys(repo for _, repo, _ in items):
        registry.client.push_blob(repo, shared.blob)
    return registry.push_many(items, workers=8)


async def _pull_all(socket: str, refs: Sequence[str], concurrency: int) -> None:
    async with grpc.aio.insecure_channel(cri.target(socket)) as ch:
        call = ch.unary_unary(PULL)
        sem = asyncio.Semaphore(concurrency)

        async def one(ref: str) -> None:
            async with sem:
                await call(cri.pull_image_request(ref), timeout=300)

        await asyncio.gather(*(one(r) for r in refs))


def pull_into(socket: str, refs: Sequence[str], *, concurrency: int = 16) -> None:
    """PullImage every ref on the runtime at ``socket`` (raises on the first failure)."""
    asyncio.run(_pull_all(socket, refs, concurrency))


def pinned_set(name: str, refs: Sequence[str]) -> str:
    """A PinnedImageSet document, as the machine-config operator would write it."""
    items = "".join(f"    - name: {r}\n" for r in refs)
    return (f"apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\n"
            f"metadata:\n  name: {name}\n  labels:\n    machineconfiguration.openshift.io/role: worker\n"
            f"spec:\n  pinnedImages:\n{items}")


def metric(port: int, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample from the shim's Prometheus endpoint (None when the series does not exist)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:  # closed now, not at the next GC
        text = response.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base != name:
            continue
        got = ",".join(sorted(p for p in rest.rstrip("}").split(",") if p))
        if got == want:
            return float(value)
    return None


class Presence:
    """Asks containerd directly (one kept channel) whether images are present."""

    def __init__(self, socket: str) -> None:
        self._channel = grpc.insecure_channel(cri.target(socket))
        self._status = self._channel.unary_unary("/runtime.v1.ImageService/ImageStatus")

    def present(self, ref: str) -> bool:
        return cri.decode_image_status_response(self._status(cri.image_status_request(ref), timeout=10)) is not None

    def wait_all(self, refs: Sequence[str], timeout: float, interval: float = 0.01) -> float | None:
        """Seconds until every ref is present (None on timeout), polling every ``interval``."""
        import time

        t0 = time.monotonic()
        missing = list(refs)
        while missing:
            missing = [r for r in missing if not self.present(r)]
            if not missing:
                break
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(interval)
        return time.monotonic() - t0

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Presence":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
