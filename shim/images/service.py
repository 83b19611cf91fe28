"""The ImageService struct: the dependencies every intercepted image RPC uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from ..cri.upstream import Upstream
from ..errors import RpcError, invalid_request
from ..observability import logs
from ..observability.metrics import Metrics
from ..observability.tracing import Tracing
from ..pulls.scheduler import PullScheduler
from ..runtime_handlers.resolver import HandlerResolver
from .pin_set import PinSet

M = TypeVar("M", bound=Message)
_log = logs.get("pins")


@dataclass
class ImageService:
    upstream: Upstream
    scheduler: PullScheduler
    metrics: Metrics
    pins: PinSet = field(default_factory=lambda: PinSet.build(()))
    pins_enforce: bool = True
    dedup_per_namespace: bool = False
    handlers: HandlerResolver | None = None  # runtime_handlers (KEP-4216), when configured
    tracing: Tracing = field(default_factory=Tracing.off)
    pin_patterns: tuple[str, ...] = ()  # pins.images, as configured
    declared_pins: tuple[tuple[str, str], ...] = ()  # (image ref, image-set name)
    on_pins_changed: Callable[[], None] | None = None  # App: re-evaluate the interception table
    # set while declared_pins are those of the configured image_sets.dir (or image sets are off)
    declared_read: asyncio.Event = field(default_factory=asyncio.Event)
    pins_wait_seconds: float = 10.0  # image_sets.pins_wait_seconds

    def __post_init__(self) -> None:
        self.declared_read.set()

    def set_pins(self, patterns: Iterable[str], *, enforce: bool) -> None:
        """Apply pins.images and pins.mode. Raises ValueError (nothing changed) on a bad pattern."""
        patterns = tuple(patterns)
        self.pins = PinSet.build(patterns, self.declared_pins)
        if (patterns, enforce) != (self.pin_patterns, self.pins_enforce):
            logs.log(_log, logging.INFO, "pins in force", patterns=len(patterns), declared=len(self.declared_pins),
                     mode="enforce" if enforce else "mark-only")
        self.pin_patterns = patterns
        self.pins_enforce = enforce

    def set_declared_pins(self, declared: Iterable[tuple[str, str]]) -> None:
        """The images of declared image sets that pin: (image ref, set name). Replaces the previous list.

        A ref that is not a valid reference is skipped (the image-set loader reports it).
        """
        declared = tuple(declared)
        self.pins = PinSet.build(self.pin_patterns, declared)
        self.declared_pins = declared
        self.declared_read.set()
        if self.on_pins_changed is not None:
            self.on_pins_changed()

    def expect_declared_pins(self) -> None:
        """An image-set directory is about to be read: removals wait for it (the pins in force stay)."""
        self.declared_read.clear()

    async def wait_declared_pins(self) -> None:
        """Return once the declared pins are read; UNAVAILABLE after image_sets.pins_wait_seconds."""
        if self.declared_read.is_set():
            return
        try:
            await asyncio.wait_for(self.declared_read.wait(), self.pins_wait_seconds)
        except TimeoutError:
            raise RpcError(grpc.StatusCode.UNAVAILABLE,
                           f"cri-shim: the image sets in image_sets.dir are not read yet (waited "
                           f"{self.pins_wait_seconds:g}s, image_sets.pins_wait_seconds); not removing an image "
                           "they may pin, retry") from None


def decode(cls: type[M], data: bytes) -> M:
    """Parse a request; malformed bytes become INVALID_ARGUMENT naming the message."""
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise invalid_request(cls.DESCRIPTOR.name, e) from None


@contextlib.contextmanager
def counting_upstream_errors(svc: ImageService, method: str) -> Iterator[None]:
    """Count the runtime's errors on an intercepted call (metrics.upstream_errors); they pass on unchanged."""
    try:
        yield
    except RpcError as e:
        if e.from_upstream:
            svc.metrics.upstream_errors.labels(method, e.code.name).inc()
        raise
