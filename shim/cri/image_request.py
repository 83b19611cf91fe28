"""The ImageSpec of an image request (PullImage, ImageStatus, RemoveImage), read and spliced
at the wire level: every other byte of the request stays as the client sent it.
"""

from __future__ import annotations

from shim.proto.runtime.v1 import api_pb2

from . import protowire as wire
from .fields import IMAGE_SPEC, IMAGE_SPEC_RUNTIME_HANDLER

__all__ = ["image_spec", "image_spec_fields", "with_runtime_handler"]


def image_spec_fields(request: bytes) -> bytes:
    """Every occurrence of the request's ImageSpec field, tag and length included, as sent.

    The ImageSpec has one number in every image request, so these bytes are also an
    ImageStatusRequest for the same image. Raises protowire.WireError on bytes it cannot scan.
    """
    return b"".join(request[start:end] for number, wtype, start, _, end in wire.fields(request)
                    if number == IMAGE_SPEC and wtype == wire.LEN)


def image_spec(request: bytes) -> api_pb2.ImageSpec:
    """The request's ImageSpec, its occurrences merged as protobuf does. Raises
    protowire.WireError or protobuf's DecodeError on a malformed request."""
    return api_pb2.ImageStatusRequest.FromString(image_spec_fields(request)).image


def with_runtime_handler(request: bytes, handler: str) -> bytes:
    """An image request with ``handler`` appended to its ImageSpec; every other byte as it was."""
    return wire.append_to_submessage(request, IMAGE_SPEC, wire.string_field(IMAGE_SPEC_RUNTIME_HANDLER, handler))
