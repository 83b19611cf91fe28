"""ImageStatus: the runtime's answer, with the image marked pinned if a pin protects it.

The request goes to the runtime unchanged (once it is known to parse: a malformed one
is refused with INVALID_ARGUMENT, like on every intercepted method), except for a
runtime handler that a ``runtime_handlers`` rule adds to its ImageSpec
(shim/runtime_handlers/inject.py). A missing image is an empty response (no ``image``), not an error,
and passes through as it is.

Without a ``runtime_handlers`` rule for images the relay engine does not run this handler:
the call is relayed and only the response message is rewritten (``mark``, a ``Patch`` in
shim/process/app.py; shim/relay/patched.py). The runtime then judges a malformed request
itself (containerd answers an empty image name with its own error, not the shim's
INVALID_ARGUMENT).
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


def mark(svc: ImageService, response: bytes) -> bytes:
    """A relayed ImageStatusResponse message, marked with the pins in force now."""
    return mark_status(svc.pins, response)
