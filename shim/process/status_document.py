"""The `cri-shim status` document: what a running shim holds now, as one JSON-able dict.

It holds the upstream's state, the pull queue and in-flight pulls with their waiters
(``PullScheduler.snapshot()``, with each pull's progress) and one entry per registered
status source (``App.status_sources``: name -> callable returning a JSON-able dict; image
sets, the cluster source and the relay register theirs). Nothing in it is a credential:
pull keys hold hashes of auth, and sources must follow the same rule.

Served by process/admin.py; shown to a person by process/status_render.py.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

from ..config import Config
from ..cri.upstream import Upstream
from ..observability import logs
from ..observability.tracing import Tracing, shim_version
from ..pulls.poller import ProgressPoller
from ..pulls.scheduler import PullScheduler

_log = logs.get("status")

StatusSource = Callable[[], dict[str, Any]]


def collect(cfg: Config, scheduler: PullScheduler, progress: ProgressPoller | None, upstream: Upstream,
            tracing: Tracing, sources: Mapping[str, StatusSource], started_at: float) -> dict[str, Any]:
    """The status document of a running shim."""
    pulls = scheduler.snapshot()
    for row in pulls["in_flight"]:
        flight_id = row["id"]  # an int: PullScheduler.snapshot's rows are dict[str, object]
        view = progress.view(flight_id) if progress is not None and isinstance(flight_id, int) else None
        if view is not None:
            row["progress"] = view
    out: dict[str, Any] = {
        "version": shim_version(),
        "pid": os.getpid(),
        "uptime_seconds": round(time.monotonic() - started_at, 1),
        "upstream": {"target": upstream.target, "state": upstream.state},
        "pulls": {"max_parallel": cfg.pulls.max_parallel, "dedup": cfg.pulls.dedup,
                  "progress_interval_seconds": cfg.pulls.progress_interval_seconds,
                  "stall_timeout_seconds": cfg.pulls.stall_timeout_seconds,
                  "stall_min_bytes_per_second": cfg.pulls.stall_min_bytes_per_second,
                  "slots": scheduler.slots.describe(), "running": scheduler.running.describe(), **pulls},
        "tracing": dict(tracing.description) if tracing.enabled else {"exporter": "off"},
    }
    for name, source in list(sources.items()):
        try:
            out[name] = source()
        except Exception as e:  # a broken source must not hide the rest
            logs.log(_log, logging.WARNING, "status source failed", source=name, error=type(e).__name__)
            out[name] = {"error": f"status source failed: {type(e).__name__}"}
    return out
