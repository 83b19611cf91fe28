"""A private registry + containerd with a few images pulled, for benchmarks."""

from __future__ import annotations

import os

from . import cri, oci
from .containerd import Containerd
from .registry import RegistryWithProxy


class BenchEnv:
    def __init__(self, workdir: str, images: int = 20) -> None:
        self.workdir = workdir
        self.images = images
        self.registry = RegistryWithProxy(os.path.join(workdir, "registry"))
        self.containerd: Containerd | None = None

    def start(self) -> tuple[str, str]:
        """Returns (containerd endpoint, one pulled image reference)."""
        self.registry.start()
        self.containerd = Containerd(os.path.join(self.workdir, "containerd"), registries=[self.registry.host])
        self.containerd.start()
        pushed = self.registry.push_many(
            [(oci.make_image(unique=f"bench-{i}"), f"bench/app{i}", "v1") for i in range(self.images)])
        for p in pushed:
            cri.call(self.containerd.socket, "/runtime.v1.ImageService/PullImage",
                     cri.pull_image_request(p.ref), timeout=60).unwrap()
        return self.containerd.endpoint, pushed[0].ref

    def stop(self) -> None:
        if self.containerd is not None:
            self.containerd.stop()
        self.registry.stop()
