"""ListImages and StreamImages: the runtime's answer, with pinned images marked.

The request goes to the runtime unchanged (once it is known to parse: a malformed one
is refused with INVALID_ARGUMENT, like on every intercepted method). Without pins the
response bytes pass through without being decoded. With pins, the relay engine relays
ListImages and rewrites only its response message (``mark_list``, a ``Patch`` in
shim/process/app.py), unless a ``runtime_handlers`` rule applies to images.
"""

from __future__ import annotations

from typing import AsyncIterator

from ..cri.call import Call
from ..proto.runtime.v1 import api_pb2
from .mark_pinned import mark_images
from .service import ImageService, counting_upstream_errors, decode


async def list_images(svc: ImageService, request: bytes, call: Call) -> bytes:
    decode(api_pb2.ListImagesRequest, request)
    with counting_upstream_errors(svc, "ListImages"):
        response = await call.forward(request)
    return mark_images(svc.pins, response, api_pb2.ListImagesResponse)


async def stream_images(svc: ImageService, request: bytes, call: Call) -> AsyncIterator[bytes]:
    decode(api_pb2.StreamImagesRequest, request)
    with counting_upstream_errors(svc, "StreamImages"):
        async for response in call.forward_stream(request):
            yield mark_images(svc.pins, response, api_pb2.StreamImagesResponse)


def mark_list(svc: ImageService, response: bytes) -> bytes:
    """A relayed ListImagesResponse message, marked with the pins in force now."""
    return mark_images(svc.pins, response, api_pb2.ListImagesResponse)
