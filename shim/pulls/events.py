"""What the pull-progress poller (poller.py) tells an observer (the shim's metrics).

The scheduler's own events (a flight queued, started, joined, finished) are ``PullEvents``
in scheduler.py, next to the ``Flight`` they carry. observability/metrics.py implements both;
an observer must not raise.
"""

from __future__ import annotations

from typing import Protocol


class ProgressEvents(Protocol):
    def content_called(self, method: str) -> None:
        """The poller called the runtime's content API (``method``: ListStatuses, List, Read, Abort)."""

    def downloaded(self, nbytes: int) -> None:
        """Upstream pulls brought ``nbytes`` more into the runtime (each blob counted once node-wide)."""

    def pull_throughput(self, bytes_per_second: float) -> None:
        """A pull of 1 MiB or more ended: its bytes divided by its running time."""

    def in_flight_bytes(self, done: int, total: int) -> None:
        """Bytes done and total of the running pulls whose size is known."""

    def pull_stalled(self) -> None:
        """The stall guard ended a pull (pulls.stall_timeout_seconds)."""

    def pull_made_no_progress(self, phase: str) -> None:
        """The no-progress guard ended a pull that hung in ``phase`` (resolving, downloading)."""
