"""The ImageService struct: the dependencies every intercepted image RPC uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from ..cri.tracer import NO_TRACING, Tracer
from ..cri.upstream import Upstream
from ..errors import RpcError, invalid_request
from ..observability import logs
from ..pulls.pod_priority import PodPriority
from ..pulls.scheduler import PullScheduler
from ..runtime_handlers.resolver import HandlerResolver
from .events import ImageEvents
from .pin_set import PinSet

M = TypeVar("M", bound=Message)
_log = logs.get("pins")


@dataclass
class ImageService:
    """Built complete by the process (process/app.py); ``configure`` applies a reload, and
    ``set_declared_pins`` the pins of declared image sets."""

    upstream: Upstream
    scheduler: PullScheduler
    events: ImageEvents  # the metrics
    handlers: HandlerResolver | None = None  # runtime_handlers (KEP-4216), when configured
    pod_priority: PodPriority | None = None  # a trusted pull's pod priority (pulls.priority_rules, the lookup)
    tracing: Tracer = NO_TRACING
    pin_patterns: tuple[str, ...] = ()  # pins.images, as configured
    pins_enforce: bool = True  # pins.mode
    dedup_per_namespace: bool = False  # pulls.dedup_per_namespace
    pins_wait_seconds: float = 10.0  # image_sets.pins_wait_seconds
    pins: PinSet = field(init=False)  # the patterns and the declared pins, in force
    # set while the declared pins (pins.declared) are those of the configured image_sets.dir (or image sets are off)
    declared_read: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        """Raises ValueError on a bad pattern in ``pin_patterns``."""
        self.pin_patterns = tuple(self.pin_patterns)
        self.pins = PinSet.build(self.pin_patterns)
        self.declared_read.set()
        if self.pin_patterns or not self.pins_enforce:
            self._log_pins()

    def configure(self, pin_patterns: Iterable[str], *, pins_enforce: bool, dedup_per_namespace: bool,
                  pins_wait_seconds: float) -> None:
        """Apply a reload (pins.images, pins.mode, pulls.dedup_per_namespace,
        image_sets.pins_wait_seconds). Raises ValueError (nothing changed) on a bad pattern."""
        patterns = tuple(pin_patterns)
        pins = PinSet.build(patterns, self.pins.declared)
        changed = (patterns, pins_enforce) != (self.pin_patterns, self.pins_enforce)
        self.pins, self.pin_patterns, self.pins_enforce = pins, patterns, pins_enforce
        self.dedup_per_namespace, self.pins_wait_seconds = dedup_per_namespace, pins_wait_seconds
        if changed:
            self._log_pins()

    def _log_pins(self) -> None:
        logs.log(_log, logging.INFO, "pins in force", patterns=len(self.pin_patterns),
                 declared=len(self.pins.declared), mode="enforce" if self.pins_enforce else "mark-only")

    def set_declared_pins(self, declared: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        """The images of declared image sets that pin, replacing the previous ones: the
        reconciler's snapshot (normalized ref -> set name, kept as it is), or (image ref, set
        name) pairs (normalized; a ref that is not a valid reference is skipped, the image-set
        loader reports it). The process's interception table depends on the pins:
        App.declare_pins calls this and re-evaluates it, in one call.
        """
        self.pins = PinSet.build(self.pin_patterns, declared)
        self.declared_read.set()

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
    """Count the runtime's errors on an intercepted call (``upstream_error``); they pass on unchanged."""
    try:
        yield
    except RpcError as e:
        if e.from_upstream:
            svc.events.upstream_error(method, e.code.name)
        raise
