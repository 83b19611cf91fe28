"""A scripted image store behind the fake runtime: ImageStatus, ListImages,
StreamImages and RemoveImage answer like containerd's CRI plugin does.

ImageStatus resolves a tag, a digest reference or an ID (``nginx`` means
``docker.io/library/nginx:latest``); a missing image is an empty response, not an
error. RemoveImage removes every name of the image; removing an unknown image
succeeds. Responses are the runtime's own bytes: ``extra`` bytes (e.g. unknown
fields) appended to an image's encoding are kept, so tests can check they survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from shim import reference
from shim.cri import protowire as wire
from shim.proto.runtime.v1 import api_pb2

SVC = "/runtime.v1.ImageService/"


@dataclass
class StoredImage:
    id: str
    tags: list[str]
    digests: list[str] = field(default_factory=list)
    size: int = 1000
    pinned: bool = False  # what the runtime itself reports (containerd pins its sandbox image)
    extra: bytes = b""  # appended to the encoded Image (unknown fields)

    def encode(self) -> bytes:
        img = api_pb2.Image(id=self.id, repo_tags=self.tags, repo_digests=self.digests, size=self.size,
                            pinned=self.pinned)
        return img.SerializeToString() + self.extra

    def names(self) -> set[str]:
        return {self.id, *self.tags, *self.digests}


def image_id(n: int) -> str:
    return "sha256:" + f"{n:x}".rjust(64, "0")


class FakeImageStore:
    def __init__(self, images: list[StoredImage] | None = None) -> None:
        self.images = list(images or [])
        self.list_extra = b""  # appended to every ListImagesResponse (an unknown top-level field)
        self.status_info: list[tuple[str, str]] = []  # verbose info map entries, in this wire order

    def add(self, img: StoredImage) -> StoredImage:
        self.images.append(img)
        return img

    def resolve(self, name: str) -> StoredImage | None:
        try:
            key = reference.normalize(name)
        except reference.InvalidReference:
            key = name
        for img in self.images:
            if key in img.names() or name in img.names():
                return img
        return None

    def install(self, runtime: Any) -> None:
        runtime.unary[SVC + "ImageStatus"] = self._status
        runtime.unary[SVC + "ListImages"] = self._list
        runtime.unary[SVC + "RemoveImage"] = self._remove
        runtime.streams[SVC + "StreamImages"] = self._stream

    def list_bytes(self) -> bytes:
        return b"".join(wire.len_field(1, img.encode()) for img in self.images) + self.list_extra

    async def _status(self, request: bytes, context: Any) -> bytes:
        req = api_pb2.ImageStatusRequest.FromString(request)
        img = self.resolve(req.image.image)
        if img is None:
            return b""
        info = b"".join(wire.len_field(2, wire.string_field(1, k) + wire.string_field(2, v))
                        for k, v in self.status_info) if req.verbose else b""
        return wire.len_field(1, img.encode()) + info

    async def _list(self, request: bytes, context: Any) -> bytes:
        return self.list_bytes()

    async def _remove(self, request: bytes, context: Any) -> bytes:
        req = api_pb2.RemoveImageRequest.FromString(request)
        img = self.resolve(req.image.image)
        if img is not None:
            self.images.remove(img)
        return b""

    async def _stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(0, len(self.images), 2):  # two images per message
            yield b"".join(wire.len_field(1, img.encode()) for img in self.images[i:i + 2])
