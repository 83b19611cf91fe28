"""The pull key: who asks for which pull. One builder, used by kubelet's pulls and by prefetch.

The scheduler's join rule (shim/pulls/scheduler.py) compares these keys, so a kubelet pull
and an image-set prefetch of the same image must build them the same way: the image by its
normalized name, the credentials by a hash of the whole AuthConfig, never the secret.

Only the first caller's request of a collapsed pull goes upstream, so two CRI clients share a
pull only when their requests would make the runtime do the same thing: the key also holds the
reference as the client spelled it (``requested``). The normal form is not that: the runtimes
do not pull under it (containerd keeps the host's case, and its ``certs.d`` and localhost checks
are case-sensitive; CRI-O resolves ``nginx`` through its search registries, not as
``docker.io/library/nginx``). The one spelling difference no runtime sees is the implied tag:
kubelet, containerd and CRI-O all read ``app`` as ``app:latest``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from google.protobuf.message import Message

from .. import reference
from ..proto.runtime.v1 import api_pb2


@dataclass(frozen=True, slots=True)
class PullKey:
    """``image`` is the normalized reference (``reference.pull_name``): the group of pulls of one
    image; ``requested`` the reference as sent (``requested``): equal keys mean the same request
    upstream. ``auth`` is a hash."""

    image: str
    handler: str = ""
    auth: str = ""
    namespace: str = ""
    sent_as: str = ""  # the client's :path if not the canonical one: its flight goes upstream under it
    requested: str = ""


def auth_key(auth: Message) -> str:
    """A hash of the full AuthConfig (never the secret itself); '' when there is none.

    Credentials are equal when every AuthConfig field is: a pull is never shared between
    credentials that merely look alike (``auth`` versus username and password).
    """
    raw = auth.SerializeToString(deterministic=True)
    return hashlib.sha256(raw).hexdigest() if raw else ""


def requested(image: str) -> str:
    """``image`` as the client spelled it, with the tag ``latest`` it implies written out
    (``reg/app`` -> ``reg/app:latest``; ``nginx`` stays a short name, ``LOCALHOST:5000/app``
    keeps its case). A reference that does not parse is kept as it is."""
    try:
        ref = reference.parse(image)
    except reference.InvalidReference:
        return image
    return image if ref.tag is not None or ref.digest is not None else f"{image}:{reference.DEFAULT_TAG}"


def pull_key(req: api_pb2.PullImageRequest, handler: str, *, namespace: str = "", sent_as: str = "") -> PullKey:
    """The key of a PullImage request that goes upstream with runtime handler ``handler``.

    Grouped under the normalized name (nginx = docker.io/library/nginx:latest), equal only for
    the same spelling (``requested``): the runtime gets the request as it was sent. Callers
    check the name first (errors.check_image_name).
    """
    image = req.image.image
    return PullKey(image=reference.pull_name(image), handler=handler, auth=auth_key(req.auth),
                   namespace=namespace, sent_as=sent_as, requested=requested(image))
