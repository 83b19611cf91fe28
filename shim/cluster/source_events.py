"""What the cluster source (source.py) tells an observer (the shim's metrics).

A ``Protocol``: observability/metrics.py implements it without importing the cluster source,
which is loaded only with cluster.kubeconfig; mypy checks that it does where process/app.py
hands the metrics over. An observer must not raise.
"""

from __future__ import annotations

from typing import Protocol


class SourceEvents(Protocol):
    def invalid_declarations(self, source: str, count: int) -> None:
        """``count`` sets of ``source`` (cluster) have a newest version that is refused (its last
        valid one stays). The same event as ImageSetEvents'."""

    def secret_errors(self, count: int) -> None:
        """``count`` cluster sets name a pull Secret that cannot be read or used."""

    def cluster_state_write_failed(self) -> None:
        """A write of cluster.state_file failed (the check at start, or a save)."""

    def cluster_state_error(self, failing: bool) -> None:
        """Whether cluster.state_file cannot be read or written now."""
