"""A runtime handler the shim chose for an image request, and why."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    """A handler the shim chose. ``source`` is for people, ``kind`` is a metric label."""

    handler: str
    source: str  # "runtime_handlers.rules[0]", "pod <uid> learned from RunPodSandbox", ...
    kind: str  # rule | pod | lookup
