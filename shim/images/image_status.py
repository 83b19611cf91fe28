"""ImageStatus: the runtime's answer, with the image marked pinned if a pin protects it.

The request goes to the runtime unchanged (once it is known to parse: a malformed one
is refused with INVALID_ARGUMENT, like on every intercepted method), except for a
runtime handler that a ``runtime_handlers`` rule adds to its ImageSpec
(shim/runtime_handlers/inject.py). A missing image is an empty response (no ``image``), not an error,
and passes through as it is.
"""

from __future__ import annotations

from ..cri.call import Call
from ..errors import check_image_name
from ..proto.runtime.v1 import api_pb2
from ..runtime_handlers.inject import inject_image_handler
from .mark_pinned import mark_status
from .service import ImageService, counting_upstream_errors, decode


async def image_status(svc: ImageService, request: bytes, call: Call) -> bytes:
    req = decode(api_pb2.ImageStatusRequest, request)
    check_image_name(req.image.image, "ImageStatusRequest.image.image")
    request = inject_image_handler(svc.handlers, svc.events, request, req)
    with counting_upstream_errors(svc, "ImageStatus"):
        response = await call.forward(request)
    return mark_status(svc.pins, response)
