"""Setting ``Image.pinned`` on images a pin protects, in response bytes.

The runtime's response is decoded only to read each image's names; the bytes sent on
are the runtime's own with ``pinned = true`` appended to the matching Image
sub-messages (a later scalar wins when a parser meets a field twice). Everything
else, unknown fields and map order included, reaches the client as the runtime
sent it. A response we cannot parse is passed on untouched.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from ..cri import protowire as wire
from ..cri.fields import IMAGE_PINNED, RESPONSE_IMAGES, STATUS_IMAGE
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from .pin_set import PinSet

_log = logs.get("pins")

PINNED_TRUE = wire.varint_field(IMAGE_PINNED, 1)  # Image.pinned = true


def pin_of(pins: PinSet, image: api_pb2.Image) -> str | None:
    """The pin protecting ``image`` (canonical pattern), or None."""
    return pins.match_image(image.id, image.repo_tags, image.repo_digests)


def mark_images(pins: PinSet, data: bytes,
                cls: type[api_pb2.ListImagesResponse] | type[api_pb2.StreamImagesResponse]) -> bytes:
    """A ListImagesResponse / StreamImagesResponse with every protected image marked pinned."""
    if not pins:
        return data
    try:
        msg = cls.FromString(data)
        spans = [(start, value_start, end) for number, wtype, start, value_start, end in wire.fields(data)
                 if number == RESPONSE_IMAGES and wtype == wire.LEN]
    except (DecodeError, wire.WireError):
        logs.log(_log, logging.WARNING, "cannot parse runtime response; passed on unmarked",
                 message=cls.DESCRIPTOR.name)
        return data
    if len(spans) != len(msg.images):  # cannot happen for a valid message; never guess
        return data
    out: list[bytes] = []
    pos = 0
    for image, (start, value_start, end) in zip(msg.images, spans):
        if image.pinned or pin_of(pins, image) is None:
            continue
        out.append(data[pos:start])
        out.append(wire.len_field(RESPONSE_IMAGES, data[value_start:end] + PINNED_TRUE))
        pos = end
    if not out:
        return data
    out.append(data[pos:])
    return b"".join(out)


def mark_status(pins: PinSet, data: bytes) -> bytes:
    """An ImageStatusResponse with its image marked pinned if a pin protects it."""
    if not pins:
        return data
    try:
        msg = api_pb2.ImageStatusResponse.FromString(data)
    except DecodeError:
        logs.log(_log, logging.WARNING, "cannot parse runtime response; passed on unmarked",
                 message="ImageStatusResponse")
        return data
    if not msg.HasField("image") or msg.image.pinned or pin_of(pins, msg.image) is None:
        return data
    return wire.append_to_submessage(data, STATUS_IMAGE, PINNED_TRUE)
