"""The ImageService struct: the dependencies every intercepted image RPC uses."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from ..errors import invalid_request
from ..metrics import Metrics
from ..pins import PinSet
from ..pulls.scheduler import PullScheduler
from ..tracing import Tracing
from ..upstream import Upstream

PULL_IMAGE = "/runtime.v1.ImageService/PullImage"
IMAGE_STATUS = "/runtime.v1.ImageService/ImageStatus"
LIST_IMAGES = "/runtime.v1.ImageService/ListImages"
STREAM_IMAGES = "/runtime.v1.ImageService/StreamImages"
REMOVE_IMAGE = "/runtime.v1.ImageService/RemoveImage"
IMAGE_FS_INFO = "/runtime.v1.ImageService/ImageFsInfo"

M = TypeVar("M", bound=Message)


@dataclass
class ImageService:
    upstream: Upstream
    scheduler: PullScheduler
    metrics: Metrics
    pins: PinSet = field(default_factory=lambda: PinSet.build(()))
    pins_enforce: bool = True
    dedup_per_namespace: bool = False
    handlers: object | None = None  # shim.handlers.HandlerResolver, when configured
    tracing: Tracing = field(default_factory=Tracing.off)


def decode(cls: type[M], data: bytes) -> M:
    """Parse a request; malformed bytes become INVALID_ARGUMENT naming the message."""
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise invalid_request(cls.DESCRIPTOR.name, e) from None


def auth_key(auth: Message) -> str:
    """A hash of the full AuthConfig (never the secret itself); '' when there is none."""
    raw = auth.SerializeToString(deterministic=True)
    return hashlib.sha256(raw).hexdigest() if raw else ""
