"""What the intercepted image calls tell an observer (the shim's metrics). An observer must not raise."""

from __future__ import annotations

from typing import Protocol

from ..runtime_handlers.events import HandlerEvents


class ImageEvents(HandlerEvents, Protocol):
    def pull_requested(self, priority: str) -> None:
        """A CRI client's PullImage arrived, at ``priority`` (foreground, untrusted)."""

    def remove_denied(self) -> None:
        """A RemoveImage was refused: the image is pinned."""

    def upstream_error(self, method: str, code: str) -> None:
        """The runtime answered a call the shim made itself with error ``code`` (one per upstream call)."""
