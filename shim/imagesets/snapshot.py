"""What the reconciler publishes about its sets: typed, built from counts kept as images change
state, so reading it costs the number of sets, never the number of images.

``cri-shim status`` (via ``ImageSets.status``) and the cluster's ``NodeImageSetStatus``
read these; nothing outside imagesets/ reads the reconciler's own fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Sequence


class State(enum.IntEnum):
    """Where one declared image stands. ``Counts`` has a field of each state's ``label``."""

    PRESENT = 0
    PULLING = 1  # handed to the scheduler
    QUEUED = 2  # missing, waiting for a lane (or for disk space)
    FAILED = 3  # waiting for its retry
    UNKNOWN = 4  # declared since the last ListImages

    @property
    def label(self) -> str:
        return self.name.lower()


COUNTED = ("declared", *(s.label for s in State if s is not State.UNKNOWN))
"""What a set reports: the state labels of cri_shim_image_set_images, the counts of a status row."""


@dataclass(frozen=True, slots=True)
class Counts:
    declared: int = 0
    present: int = 0
    pulling: int = 0
    queued: int = 0
    failed: int = 0
    unknown: int = 0

    @classmethod
    def of(cls, declared: int, by_state: Sequence[int]) -> Counts:
        """From counts indexed by State."""
        return cls(declared, **{s.label: by_state[s] for s in State})

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COUNTED}

    def by_state(self) -> dict[str, int]:
        """Images by state label, unknown included."""
        return {s.label: getattr(self, s.label) for s in State}


if tuple(f.name for f in fields(Counts)) != ("declared", *(s.label for s in State)):
    raise AssertionError("Counts must have declared and one field per State, in State's order")


@dataclass(frozen=True, slots=True)
class SetSnapshot:
    name: str
    kind: str
    source: str  # the file, or the cluster object
    generation: str
    pin: bool
    counts: Counts
    failed_reasons: dict[str, int]  # typed reason (pulls/failure.py REASONS) -> images failed
    last_error: str  # the most recent failure of an image of this set ("image: error"), "" when none
    blocked: str  # why queued images of this set cannot start (disk guards), or why none are known (runtime)
    pinned: int | None  # images of a pinning set matched by the pins in force; None when not pinning
    pulling: tuple[str, ...]  # spelled names of its images being pulled now
    ignored: tuple[str, ...] = ()
    runtime_handlers: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """Every image present (and pinned, when the set pins)."""
        c = self.counts
        return c.present == c.declared and (self.pinned is None or self.pinned == c.declared)


@dataclass(frozen=True, slots=True)
class Snapshot:
    sets: dict[str, SetSnapshot]  # by name, sorted
    totals: Counts  # distinct images (an image in two sets counts once)
    refused: dict[str, str]  # set name -> why it is not (or no longer) applied as declared
    disk_blocked: str
    runtime_error: str
    passes: int  # ListImages passes finished; grows by one per pass
    # prefetch held below kubelet's image GC threshold: message and numbers (threshold.py), or None
    disk_pressure: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
