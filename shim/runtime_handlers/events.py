"""What runtime-handler injection tells an observer (the shim's metrics). An observer must not raise."""

from __future__ import annotations

from typing import Protocol


class HandlerEvents(Protocol):
    def handler_injected(self, source: str) -> None:
        """A runtime handler was set on an image request, chosen by ``source`` (Decision.kind)."""
