"""An image store scripted on the fake runtime: ListImages, PullImage, ImageStatus, ImageFsInfo.

Pulls add the image (normalized tag, or repo digest for a digest reference) the way
containerd reports it. Tests can hold a pull until released, fail it a number of
times, and read back which pulls started, finished or were cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

import grpc

from shim.proto.runtime.v1 import api_pb2
from shim.reference import normalize
from tests.support.fake_runtime import FakeRuntime

SERVICE = "/runtime.v1.ImageService/"


def image_id(ref: str) -> str:
    return "sha256:" + hashlib.sha256(ref.encode()).hexdigest()


def make_image(ref: str) -> api_pb2.Image:
    canon = normalize(ref)
    img = api_pb2.Image(id=image_id(canon), size=1234)
    if "@" in canon:
        img.repo_digests.append(canon)
    else:
        img.repo_tags.append(canon)
    return img


@dataclass
class FakeImages:
    rt: FakeRuntime
    mountpoint: str = "/var/lib/fake-runtime/images"
    images: dict[str, api_pb2.Image] = field(default_factory=dict)  # normalized ref -> image
    pulls: list[str] = field(default_factory=list)  # image field of every PullImage, in order
    pull_requests: list[api_pb2.PullImageRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    failures: dict[str, tuple[int, grpc.StatusCode]] = field(default_factory=dict)  # ref -> (times left, code)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    hold_all: asyncio.Event | None = None  # when set: every pull waits for it
    list_error: grpc.StatusCode | None = None
    list_gate: asyncio.Event | None = None
    list_as_asked: bool = False  # the ListImages answer is the images when it was asked, not when the gate opened
    lists: int = 0
    active: int = 0
    max_active: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def install(self) -> "FakeImages":
        self.rt.unary[SERVICE + "ListImages"] = self._list
        self.rt.unary[SERVICE + "PullImage"] = self._pull
        self.rt.unary[SERVICE + "ImageFsInfo"] = self._fs_info
        self.rt.unary[SERVICE + "ImageStatus"] = self._status
        return self

    def add(self, *refs: str) -> None:
        for r in refs:
            self.images[normalize(r)] = make_image(r)

    def remove(self, ref: str) -> None:
        self.images.pop(normalize(ref), None)

    def has(self, ref: str) -> bool:
        return normalize(ref) in self.images

    def hold(self, ref: str) -> asyncio.Event:
        return self.gates.setdefault(ref, asyncio.Event())

    def fail(self, ref: str, times: int, code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND) -> None:
        self.failures[ref] = (times, code)

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:
        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), timeout)

    async def _list(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.lists += 1
        asked = list(self.images.values())
        if self.list_gate is not None:
            await self.list_gate.wait()
        if self.list_error is not None:
            await context.abort(self.list_error, "fake runtime cannot list images")
        self.changed.set()
        images = asked if self.list_as_asked else list(self.images.values())
        return api_pb2.ListImagesResponse(images=images).SerializeToString()

    async def _status(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = api_pb2.ImageStatusRequest.FromString(request).image.image
        for img in self.images.values():
            if name == img.id or normalize(name) in (*img.repo_tags, *img.repo_digests):
                return api_pb2.ImageStatusResponse(image=img).SerializeToString()
        return b""

    async def _fs_info(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        fs = api_pb2.FilesystemUsage(fs_id=api_pb2.FilesystemIdentifier(mountpoint=self.mountpoint))
        return api_pb2.ImageFsInfoResponse(image_filesystems=[fs]).SerializeToString()

    async def _pull(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = api_pb2.PullImageRequest.FromString(request)
        ref = req.image.image
        self.pulls.append(ref)
        self.pull_requests.append(req)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.changed.set()
        try:
            if self.hold_all is not None:
                await self.hold_all.wait()
            gate = self.gates.get(ref)
            if gate is not None:
                await gate.wait()
            else:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(ref)
            self.changed.set()
            raise
        finally:
            self.active -= 1
        left, code = self.failures.get(ref, (0, grpc.StatusCode.OK))
        if left > 0:
            self.failures[ref] = (left - 1, code)
            self.changed.set()
            await context.abort(code, f"fake registry: {ref} not available")
        img = make_image(ref)
        self.images[normalize(ref)] = img
        self.finished.append(ref)
        self.changed.set()
        return api_pb2.PullImageResponse(image_ref=img.id).SerializeToString()
