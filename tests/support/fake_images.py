"""A scripted image store behind the fake runtime: ImageStatus, ListImages,
StreamImages and RemoveImage answer like containerd's CRI plugin does.

ImageStatus resolves a tag, a digest reference or an ID (``nginx`` means
``docker.io/library/nginx:latest``); a missing image is an empty response, not an
error. A name that finds no image that way goes, as in containerd's LocalResolve, to
its short-ID index: a prefix of the hex digits of one ID (``""`` is a prefix of every
one) is that image, of several an UNKNOWN error ("ambiguous"). RemoveImage removes
every name of the image; removing an unknown image succeeds. Responses are the
runtime's own bytes: ``extra`` bytes (e.g. unknown fields) appended to an image's
encoding are kept, so tests can check they survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

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


class AmbiguousName(Exception):
    """More than one image has an ID that starts with the name (containerd: ErrDigestAmbiguous)."""


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
        hex_prefix = name[len("sha256:"):] if name.startswith("sha256:") and name != "sha256:" else name
        if not set(hex_prefix) <= set("0123456789abcdef"):
            return None
        by_prefix = [img for img in self.images if img.id.removeprefix("sha256:").startswith(hex_prefix)]
        if len(by_prefix) > 1:
            raise AmbiguousName(name)
        return by_prefix[0] if by_prefix else None

    async def _resolve_or_abort(self, name: str, context: Any) -> StoredImage | None:
        try:
            return self.resolve(name)
        except AmbiguousName:
            await context.abort(grpc.StatusCode.UNKNOWN, f'can not resolve "{name}" locally: ambiguous digest string')
            raise

    def install(self, runtime: Any) -> None:
        runtime.unary[SVC + "ImageStatus"] = self.image_status
        runtime.unary[SVC + "ListImages"] = self._list
        runtime.unary[SVC + "RemoveImage"] = self._remove
        runtime.streams[SVC + "StreamImages"] = self._stream

    def list_bytes(self) -> bytes:
        return b"".join(wire.len_field(1, img.encode()) for img in self.images) + self.list_extra

    async def image_status(self, request: bytes, context: Any) -> bytes:
        """The runtime's ImageStatus answer (installed as its handler; tests call it for what the runtime says)."""
        req = api_pb2.ImageStatusRequest.FromString(request)
        img = await self._resolve_or_abort(req.image.image, context)
        if img is None:
            return b""
        info = b"".join(wire.len_field(2, wire.string_field(1, k) + wire.string_field(2, v))
                        for k, v in self.status_info) if req.verbose else b""
        return wire.len_field(1, img.encode()) + info

    async def _list(self, request: bytes, context: Any) -> bytes:
        return self.list_bytes()

    async def _remove(self, request: bytes, context: Any) -> bytes:
        req = api_pb2.RemoveImageRequest.FromString(request)
        img = await self._resolve_or_abort(req.image.image, context)
        if img is not None:
            self.images.remove(img)
        return b""

    async def _stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(0, len(self.images), 2):  # two images per message
            yield b"".join(wire.len_field(1, img.encode()) for img in self.images[i:i + 2])
