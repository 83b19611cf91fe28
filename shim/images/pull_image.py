"""PullImage: through the node-wide scheduler, collapsed with identical pulls.

The request reaches the runtime as the client sent it, except that a runtime
handler chosen by the shim is appended to ImageSpec (never over one the client set).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry.trace import Span

from ..cri import protowire as wire
from ..cri.call import Call
from ..cri.deadline import ended
from ..cri.fields import IMAGE_SPEC, named
from ..cri.methods import PULL_IMAGE
from ..errors import RpcError, check_image_name, invalid_request
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from ..pulls.key import pull_key
from ..pulls.slots import Priority
from ..runtime_handlers.inject import inject
from .service import ImageService, counting_upstream_errors, decode

_log = logs.get("pull")
# Length-delimited fields (strings, messages, maps) the shim reads or appends to.
_REQUEST_FIELDS = named(api_pb2.PullImageRequest, "image", "auth", "sandbox_config")
_IMAGE_SPEC_FIELDS = named(api_pb2.ImageSpec, "image", "annotations", "user_specified_image", "runtime_handler")


def check_wire(request: bytes) -> None:
    """Refuse what protobuf parsers read leniently but the shim cannot splice safely: a
    group (wire types 3/4, not in proto3) or a known field with the wrong wire type, at
    the top level or in ImageSpec. Raises RpcError INVALID_ARGUMENT."""
    try:
        for number, wtype, _, value_start, end in wire.fields(request):
            if number in _REQUEST_FIELDS and wtype != wire.LEN:
                raise wire.WireError(f"field {number} ({_REQUEST_FIELDS[number]}) has wire type {wtype}, "
                                     "expected 2 (length-delimited)")
            if number == IMAGE_SPEC:
                for n, w, _, _, _ in wire.fields(request[value_start:end]):
                    if n in _IMAGE_SPEC_FIELDS and w != wire.LEN:
                        raise wire.WireError(f"field image.{_IMAGE_SPEC_FIELDS[n]} ({n}) has wire type {w}, "
                                             "expected 2 (length-delimited)")
    except wire.WireError as e:
        raise invalid_request("PullImageRequest", e) from None


async def pull_image(svc: ImageService, request: bytes, call: Call) -> bytes:
    req = decode(api_pb2.PullImageRequest, request)
    check_wire(request)
    image = req.image.image
    if not image:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "cri-shim: PullImageRequest.image.image is empty")
    check_image_name(image, "PullImageRequest.image.image")
    handler, how = req.image.runtime_handler, "request" if req.image.runtime_handler else "none"
    if not handler and svc.handlers is not None:
        decision = await svc.handlers.for_pull(req, call)
        if decision is not None:
            handler, how = decision.handler, decision.source
            request = inject(request, image, decision, svc.events, logging.INFO)
    namespace = req.sandbox_config.metadata.namespace if svc.dedup_per_namespace else ""
    key = pull_key(req, handler, namespace=namespace, sent_as=call.sent_as)
    # kubelet (root) and server.trusted_uids go first; any other local client within its share (pulls/slots.py)
    priority = Priority.FOREGROUND if call.peer.trusted else Priority.UNTRUSTED
    # a trusted caller's pod priority orders the trusted queue (pulls/queue.py); an untrusted one's counts for nothing
    pod_priority = (svc.pod_priority.of(req.sandbox_config)
                    if svc.pod_priority is not None and priority is Priority.FOREGROUND else 0)
    svc.events.pull_requested(priority.name.lower())
    span = call.span
    if span.is_recording():
        span.set_attributes({"cri_shim.image": image, "cri_shim.runtime_handler": handler,
                             "cri_shim.runtime_handler.source": how})

    async def run() -> bytes:  # runs once per flight, for the caller that started it
        if span.is_recording():  # the caller may have gone (deadline) while others still wait
            span.add_event("pull slot acquired")
        with (svc.tracing.client_span(PULL_IMAGE, span, call.metadata) as metadata,
              counting_upstream_errors(svc, "PullImage")):
            return await svc.upstream.unary(call.sent_as or PULL_IMAGE, request, metadata=metadata)

    try:
        outcome = await svc.scheduler.pull(key, run, priority=priority, uid=call.peer.uid,
                                           deadline=call.deadline, pod_priority=pod_priority,
                                           listener=span.add_event if span.is_recording() else None)
    except RpcError as e:
        _failed(span, image, handler, e.code.name, e.details, from_upstream=e.from_upstream)
        raise
    except asyncio.CancelledError:  # the caller went away, or (relay engine) its deadline passed
        code = ended(call.deadline)
        _failed(span, image, handler, code.name, "cri-shim: the caller's deadline passed"
                if code is grpc.StatusCode.DEADLINE_EXCEEDED else "cancelled by the caller")
        raise
    if span.is_recording():
        span.set_attributes({"cri_shim.pull.joined": outcome.joined,
                             "cri_shim.pull.queued_seconds": round(outcome.queued_seconds, 6),
                             "cri_shim.pull.result": "OK"})
    if outcome.joined:
        logs.log(_log, logging.INFO, "pull collapsed", image=image, handler=handler)
    logs.log(_log, logging.DEBUG, "pull done", image=image, handler=handler, handler_source=how,
             joined=outcome.joined, queued_seconds=round(outcome.queued_seconds, 3))
    return outcome.response


def _failed(span: Span, image: str, handler: str, code: str, details: str, *, from_upstream: bool = False) -> None:
    """Log and record a pull that did not succeed for this caller."""
    if span.is_recording():
        span.set_attribute("cri_shim.pull.result", code)
    if from_upstream:  # kubelet reports the runtime's errors itself
        logs.log(_log, logging.DEBUG, "pull failed", image=image, handler=handler, code=code)
    elif code == "CANCELLED":
        logs.log(_log, logging.DEBUG, "pull cancelled", image=image, handler=handler, reason=details)
    else:  # the shim's own answer: a deadline spent waiting (pull cap), shutdown
        logs.log(_log, logging.INFO, "pull refused", image=image, handler=handler, code=code, reason=details)
