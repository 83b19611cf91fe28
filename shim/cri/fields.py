"""The CRI field numbers the shim reads or splices at the wire level, from the descriptors of
our ``proto/runtime/v1/api.proto`` (as method paths are, shim/cri/methods.py): each number is
written once, in the proto.
"""

from __future__ import annotations

from google.protobuf.message import Message

from shim.proto.runtime.v1 import api_pb2

__all__ = ["IMAGE_PINNED", "IMAGE_SPEC", "IMAGE_SPEC_RUNTIME_HANDLER", "RESPONSE_IMAGES", "STATUS_IMAGE", "named",
           "number"]


def number(message: type[Message], field: str) -> int:
    """The number of ``field`` in ``message``; KeyError if our proto has no such field."""
    return int(message.DESCRIPTOR.fields_by_name[field].number)


def named(message: type[Message], *names: str) -> dict[int, str]:
    """Field number -> name, for the named fields of ``message``."""
    return {number(message, n): n for n in names}


def _shared(field: str, *messages: type[Message]) -> int:
    """The number of a field that several messages hold under one number (spliced alike)."""
    numbers = {number(m, field) for m in messages}
    if len(numbers) != 1:
        raise AssertionError(f"{field} has numbers {sorted(numbers)} in "
                             f"{', '.join(m.DESCRIPTOR.name for m in messages)}: splice each on its own")
    return numbers.pop()


IMAGE_SPEC = _shared("image", api_pb2.PullImageRequest, api_pb2.ImageStatusRequest, api_pb2.RemoveImageRequest)
"""The ImageSpec of an image request: PullImageRequest.image, ImageStatusRequest.image, RemoveImageRequest.image."""

IMAGE_SPEC_RUNTIME_HANDLER = number(api_pb2.ImageSpec, "runtime_handler")

RESPONSE_IMAGES = _shared("images", api_pb2.ListImagesResponse, api_pb2.StreamImagesResponse)
"""The Image messages of an image listing: ListImagesResponse.images, StreamImagesResponse.images."""

STATUS_IMAGE = number(api_pb2.ImageStatusResponse, "image")

IMAGE_PINNED = number(api_pb2.Image, "pinned")
