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
