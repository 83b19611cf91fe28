"""RemoveImage: refused for a pinned image.

The request may name the image by tag, by digest reference or by ID (kubelet's image
GC sends the ID). The runtime resolves it (ImageStatus with the request's own
ImageSpec, so a runtime handler or annotations set by the client or the shim apply to
the lookup too) to the image's ID, tags and digests. If a pin matches any of them the
call fails with FAILED_PRECONDITION naming the image and the pin. A runtime removes
every name of an image at once, so a pin on any one name protects the image under all.

With ``pins.mode: mark-only`` the removal goes ahead (and is logged). Every call made
while there are no pins reaches the runtime as the client sent it. If the lookup itself
fails, that error is returned and nothing is removed: a pin is never bypassed because
the runtime could not be asked.

A name the runtime does not know is never sent on: a pull of it (by another client, or
straight to the runtime) could land between the lookup and the removal, and the runtime
would remove an image nobody checked. The shim answers as every supported runtime answers
a RemoveImage of a missing image (RemoveImage is idempotent in CRI: containerd 1.6/1.7/2.x
return an empty response when their LocalResolve finds nothing, CRI-O v1.34 when its storage
and artifact store know neither the name nor the ID): an empty RemoveImageResponse. So is an
empty name, neither looked up nor sent on: containerd resolves a name that is no reference
by its short-ID index, where ``""`` is a prefix of every ID ("ambiguous" while it holds two
images or more, *the* image while it holds one), so the runtime would remove an image no
name of the request names (CRI-O answers ``""`` with an error, "no image specified").

A shortened ID (a prefix of the hex digits, as ``crictl images`` shows and ``crictl rmi``
sends as typed) is resolved by both runtimes and checked like any name: the image the
runtime's ImageStatus finds is the one whose pins decide. A prefix that matches several
images is an error of the runtime's lookup, returned as it is (the runtime's own
RemoveImage answers it the same way); nothing is removed.

The removal names the image the shim checked by its ID (``removal_request``), so a pull
that re-points the name (or brings a second image whose ID has the same prefix) between
the check and the removal cannot make the runtime remove another image. What no CRI call
can close: a pull that gives the checked image itself (same content) a pinned name in
between; the runtime then removes it under all its names.
While image sets are configured but their directory is not read
yet (start, or a reload to a new ``image_sets.dir``), every call first waits for it,
up to ``image_sets.pins_wait_seconds`` (then UNAVAILABLE).
"""

from __future__ import annotations

import logging
import re

import grpc
from google.protobuf.message import DecodeError

from .. import reference
from ..cri import protowire as wire
from ..cri.call import Call
from ..cri.image_request import image_spec_fields
from ..cri.methods import IMAGE_STATUS
from ..errors import RpcError, check_image_name
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from ..runtime_handlers.inject import inject_image_handler
from .mark_pinned import pin_of
from .service import ImageService, counting_upstream_errors, decode

_log = logs.get("pins")
# What containerd and CRI-O answer a RemoveImage of an image they do not have (an empty message).
MISSING_IMAGE_RESPONSE = api_pb2.RemoveImageResponse().SerializeToString()
_HEX = re.compile(r"[0-9a-f]+", re.ASCII)


def status_request(remove_request: bytes, parsed: api_pb2.RemoveImageRequest) -> bytes:
    """An ImageStatusRequest for the image a RemoveImageRequest names: its ImageSpec bytes as they are.

    (Re-encoded from ``parsed`` only if the request holds something our wire scanner
    does not read, e.g. a deprecated group field.)
    """
    try:
        return image_spec_fields(remove_request)
    except wire.WireError:
        return api_pb2.ImageStatusRequest(image=parsed.image).SerializeToString()


async def lookup(svc: ImageService, request: bytes, parsed: api_pb2.RemoveImageRequest,
                 call: Call) -> api_pb2.Image | None:
    """The image a RemoveImage request names, as the runtime knows it; None if it does not."""
    with counting_upstream_errors(svc, "ImageStatus"):
        raw = await svc.upstream.unary(IMAGE_STATUS, status_request(request, parsed), metadata=call.metadata,
                                       deadline=call.deadline)
    try:
        resp = api_pb2.ImageStatusResponse.FromString(raw)
    except DecodeError:
        raise RpcError(grpc.StatusCode.INTERNAL, "cri-shim: cannot parse the runtime's ImageStatusResponse; "
                       "not removing an image that may be pinned") from None
    return resp.image if resp.HasField("image") else None


def names_by_id(name: str, image: api_pb2.Image) -> bool:
    """True if ``name`` names ``image`` by its ID: the whole ID in either form, or a prefix of
    its hex digits (a shortened ID) that is not also one of its tags."""
    if reference.normalize_image_id(name) is not None:
        return True
    if not (_HEX.fullmatch(name) and image.id.removeprefix("sha256:").startswith(name)):
        return False
    as_tag = reference.pull_name(name)
    return not any(reference.pull_name(tag) == as_tag for tag in image.repo_tags)


def removal_request(request: bytes, req: api_pb2.RemoveImageRequest, image: api_pb2.Image) -> bytes:
    """``request`` (parsed: ``req``) naming ``image`` by its ID (other fields, unknown ones too, kept).

    containerd removes an image with all its names whichever name it is given, so the ID
    removes exactly what the name would. CRI-O removes only the given tag of an image that
    has several: such a request keeps its name (the runtime's own semantics win). A
    shortened ID is not a tag: CRI-O removes the whole image for it, so it goes as the full
    ID (sent as typed, it would be resolved again, maybe to another image by then).
    """
    name = req.image.image
    crio_untag = (not image.id.startswith("sha256:") and len(image.repo_tags) > 1
                  and not names_by_id(name, image) and "@" not in name)
    if crio_untag or name == image.id:
        return request
    req.image.image = image.id
    return req.SerializeToString()


async def remove_image(svc: ImageService, request: bytes, call: Call) -> bytes:
    # a runtime_handlers rule's handler, for the lookup too
    request = inject_image_handler(svc.handlers, svc.events, request)
    await svc.wait_declared_pins()
    pins = svc.pins
    if pins:
        req = decode(api_pb2.RemoveImageRequest, request)
        name = req.image.image
        check_image_name(name, "RemoveImageRequest.image.image")
        image = await lookup(svc, request, req, call) if name else None  # "": see the module's docstring
        if image is None:
            logs.log(_log, logging.DEBUG, "remove: the runtime does not know the image; answered without it",
                     image=name)
            return MISSING_IMAGE_RESPONSE
        pin = pin_of(pins, image)
        if pin is not None:
            tags = ",".join(image.repo_tags) or "<none>"
            if svc.pins_enforce:
                svc.events.remove_denied()
                logs.log(_log, logging.INFO, "remove refused: image is pinned", image=name, id=image.id,
                         tags=tags, pin=pins.describe(pin))
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"cri-shim: image {name} (id {image.id}, tags {tags}) is pinned by "
                               f"{pins.describe(pin)}; not removing it")
            logs.log(_log, logging.INFO, "removing a pinned image (pins.mode is mark-only)", image=name,
                     id=image.id, tags=tags, pin=pins.describe(pin))
        request = removal_request(request, req, image)
    with counting_upstream_errors(svc, "RemoveImage"):
        return await call.forward(request)
