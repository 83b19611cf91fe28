"""What image sets tell an observer (the shim's metrics), as they happen.

A ``Protocol``: observability/metrics.py implements it without importing image sets, which
are loaded only when configured (image_sets.dir or cluster.kubeconfig); mypy checks that it
does where process/app.py hands the metrics over. An observer must not raise.
"""

from __future__ import annotations

from typing import Mapping, Protocol


class ImageSetEvents(Protocol):
    def set_counts(self, set_name: str, counts: Mapping[str, int]) -> None:
        """A set's images by state label (declared, present, pulling, queued, failed) changed."""

    def set_removed(self, set_name: str, states: tuple[str, ...]) -> None:
        """A set was removed: the counts of these states it had are no longer reported."""

    def runtime_listed(self) -> None:
        """A full pass over the runtime's images (ListImages) finished."""

    def prefetch_started(self) -> None:
        """The reconciler started one of its own pulls."""

    def invalid_declarations(self, source: str, count: int) -> None:
        """``count`` declarations of ``source`` (file, cluster) have a newest version that is refused."""

    def image_sets_state_write_failed(self) -> None:
        """A write of image_sets.state_file failed (the check at start, or a save)."""

    def image_sets_state_error(self, failing: bool) -> None:
        """Whether image_sets.state_file cannot be read or written now."""

    def disk_pressure(self, numbers: Mapping[str, int | str] | None) -> None:
        """Prefetches wait below kubelet's image GC threshold (the numbers: threshold.py
        ``Pressure.numbers``), or no longer do (None)."""
