"""Appending a chosen runtime handler to an image request's ImageSpec: the one place a handler
is injected (counted in cri_shim_runtime_handler_injected and logged).

ImageStatus and RemoveImage carry no pod: only rules without pod matchers apply to them
(``inject_image_handler``). PullImage asks the resolver itself and injects with ``inject``.
"""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from ..cri import protowire as wire
from ..cri.image_request import image_spec, with_runtime_handler
from ..errors import check_image_name
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from .decision import Decision
from .events import HandlerEvents
from .resolver import HandlerResolver

_log = logs.get("handlers")


def inject_image_handler(handlers: HandlerResolver | None, events: HandlerEvents, request: bytes,
                         decoded_req: api_pb2.ImageStatusRequest | api_pb2.RemoveImageRequest | None = None) -> bytes:
    """ImageStatus / RemoveImage request bytes with a rule's handler appended to ImageSpec.

    Unchanged (the same bytes) when there is no resolver, the client set a handler, or
    no rule applies. ``decoded_req`` is the request already decoded (anything with an
    ``image`` ImageSpec), to save decoding it again.
    """
    if handlers is None or not handlers.applies_to_images:
        return request
    try:
        spec = decoded_req.image if decoded_req is not None else image_spec(request)
    except (wire.WireError, DecodeError):
        return request  # malformed: the runtime (or the pins check) answers it as it is
    if spec.runtime_handler:
        return request
    check_image_name(spec.image, "ImageSpec.image")
    decision = handlers.for_image(spec)
    if decision is None:
        return request
    return inject(request, spec.image, decision, events)


def inject(request: bytes, image: str, decision: Decision, events: HandlerEvents, level: int = logging.DEBUG) -> bytes:
    """``request`` with ``decision.handler`` appended to its ImageSpec, counted
    (cri_shim_runtime_handler_injected) and logged: the one place a handler is injected."""
    events.handler_injected(decision.kind)
    logs.log(_log, level, "runtime handler injected", image=image, handler=decision.handler, source=decision.source)
    return with_runtime_handler(request, decision.handler)
