"""The pull key: who asks for which pull. One builder, used by kubelet's pulls and by prefetch.

The scheduler's join rule (shim/pulls/scheduler.py) compares these keys, so a kubelet pull
and an image-set prefetch of the same image must build them the same way: the image by its
normalized name, the credentials by a hash of the whole AuthConfig, never the secret.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from google.protobuf.message import Message

from .. import reference
from ..proto.runtime.v1 import api_pb2


@dataclass(frozen=True, slots=True)
class PullKey:
    """``image`` is the normalized reference (``reference.pull_name``); ``auth`` is a hash."""

    image: str
    handler: str = ""
    auth: str = ""
    namespace: str = ""
    sent_as: str = ""  # the client's :path if not the canonical one: its flight goes upstream under it


def auth_key(auth: Message) -> str:
    """A hash of the full AuthConfig (never the secret itself); '' when there is none.

    Credentials are equal when every AuthConfig field is: a pull is never shared between
    credentials that merely look alike (``auth`` versus username and password).
    """
    raw = auth.SerializeToString(deterministic=True)
    return hashlib.sha256(raw).hexdigest() if raw else ""


def pull_key(req: api_pb2.PullImageRequest, handler: str, *, namespace: str = "", sent_as: str = "") -> PullKey:
    """The key of a PullImage request that goes upstream with runtime handler ``handler``.

    Collapsed under the normalized name (nginx = docker.io/library/nginx:latest); the runtime
    still gets the request as it was sent. Callers check the name first (errors.check_image_name).
    """
    return PullKey(image=reference.pull_name(req.image.image), handler=handler, auth=auth_key(req.auth),
                   namespace=namespace, sent_as=sent_as)
