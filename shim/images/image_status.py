"""ImageStatus: the runtime's answer, with the image marked pinned if a pin protects it.

The request goes to the runtime unchanged, except for a runtime handler that a
``runtime_handlers`` rule adds to its ImageSpec (shim/handlers.py). A missing image is
an empty response (no ``image``), not an error, and passes through as it is.
"""

from __future__ import annotations

from ..handlers import inject_image_handler
from ..proxy import Call
from .pinned import mark_status
from .service import ImageService, counting_upstream_errors


async def image_status(svc: ImageService, request: bytes, call: Call) -> bytes:
    request = inject_image_handler(svc, request)
    with counting_upstream_errors(svc, "ImageStatus"):
        response = await call.forward(request)
    return mark_status(svc.pins, response)
