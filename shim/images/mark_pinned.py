"""Setting ``Image.pinned`` on images a pin protects, in response bytes.

The runtime's response is read at the wire level, and only for each image's names (ID,
repo tags, repo digests) and its ``pinned`` flag: no message objects are built on this
per-call path. The bytes sent on are the runtime's own with ``pinned = true`` appended to
the matching Image sub-messages (a later scalar wins when a parser meets a field twice).
Everything else, unknown fields and map order included, reaches the client as the runtime
sent it. What the wire reader does not take as it is (a truncated field, a name that is not
UTF-8, an ImageStatusResponse with its ``image`` given twice, which parsers merge) goes
through the protobuf parser instead, as before; a response that does not parse is passed on
untouched.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from ..cri import protowire as wire
from ..cri.fields import IMAGE_PINNED, RESPONSE_IMAGES, STATUS_IMAGE, number
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from .pin_set import PinSet

_log = logs.get("pins")

PINNED_TRUE = wire.varint_field(IMAGE_PINNED, 1)  # Image.pinned = true


def pin_of(pins: PinSet, image: api_pb2.Image) -> str | None:
    """The pin protecting ``image`` (canonical pattern), or None."""
    return pins.match_image(image.id, image.repo_tags, image.repo_digests)


_ID, _TAGS, _DIGESTS = (number(api_pb2.Image, f) for f in ("id", "repo_tags", "repo_digests"))


def needs_pin(pins: PinSet, image: bytes) -> bool:
    """Is the Image message ``image`` (bytes) protected by a pin and not yet marked pinned?

    Reads the fields as a protobuf parser would: ``id`` and ``pinned`` the last occurrence,
    repo tags and digests every one; a known field with another wire type is an unknown
    field to a parser, skipped here too. Raises WireError (or UnicodeDecodeError) on what it
    cannot read."""
    image_id, pinned = "", False
    tags: list[str] = []
    digests: list[str] = []
    for num, wtype, _, value_start, end in wire.fields(image):
        if wtype == wire.LEN:
            if num == _ID:
                image_id = image[value_start:end].decode()
            elif num == _TAGS:
                tags.append(image[value_start:end].decode())
            elif num == _DIGESTS:
                digests.append(image[value_start:end].decode())
        elif num == IMAGE_PINNED and wtype == wire.VARINT:
            pinned = wire.read_varint(image, value_start)[0] != 0
    if pinned:
        return False
    return pins.match_image(image_id, tags, digests) is not None


def mark_images(pins: PinSet, data: bytes,
                cls: type[api_pb2.ListImagesResponse] | type[api_pb2.StreamImagesResponse]) -> bytes:
    """A ListImagesResponse / StreamImagesResponse with every protected image marked pinned."""
    if not pins:
        return data
    try:
        out: list[bytes] = []
        pos = 0
        for number_, wtype, start, value_start, end in wire.fields(data):
            if number_ != RESPONSE_IMAGES:
                continue
            if wtype != wire.LEN:
                raise wire.WireError("images is not length-delimited")
            if not needs_pin(pins, data[value_start:end]):
                continue
            out.append(data[pos:start])
            out.append(wire.len_field(RESPONSE_IMAGES, data[value_start:end] + PINNED_TRUE))
            pos = end
    except (wire.WireError, UnicodeDecodeError):
        return _mark_images_parsed(pins, data, cls)
    if not out:
        return data
    out.append(data[pos:])
    return b"".join(out)


def _mark_images_parsed(pins: PinSet, data: bytes,
                        cls: type[api_pb2.ListImagesResponse] | type[api_pb2.StreamImagesResponse]) -> bytes:
    """mark_images through the protobuf parser: for what the wire reader does not take."""
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
        images = [(wtype, value_start, end) for number_, wtype, _, value_start, end in wire.fields(data)
                  if number_ == STATUS_IMAGE]
        if not images:
            return data  # no image: the runtime does not have it
        if len(images) != 1 or images[0][0] != wire.LEN:
            raise wire.WireError("image given more than once (merged by parsers), or not length-delimited")
        _, value_start, end = images[0]
        if not needs_pin(pins, data[value_start:end]):
            return data
    except (wire.WireError, UnicodeDecodeError):
        return _mark_status_parsed(pins, data)
    return wire.append_to_submessage(data, STATUS_IMAGE, PINNED_TRUE)


def _mark_status_parsed(pins: PinSet, data: bytes) -> bytes:
    """mark_status through the protobuf parser: for what the wire reader does not take."""
    try:
        msg = api_pb2.ImageStatusResponse.FromString(data)
    except DecodeError:
        logs.log(_log, logging.WARNING, "cannot parse runtime response; passed on unmarked",
                 message="ImageStatusResponse")
        return data
    if not msg.HasField("image") or msg.image.pinned or pin_of(pins, msg.image) is None:
        return data
    return wire.append_to_submessage(data, STATUS_IMAGE, PINNED_TRUE)
