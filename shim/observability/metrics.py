"""Prometheus metrics, in a registry of our own (no global state).

Served as Prometheus text at ``metrics.address`` (off when unset) on the shim's event loop
(shim/observability/metrics_http.py). Labels never carry credentials: results, codes, method names,
image-set names only.
"""

from __future__ import annotations

from typing import Any, Mapping

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..images.events import ImageEvents
from ..pulls.events import ProgressEvents
from ..pulls.scheduler import Flight, PullEvents
from ..pulls.slots import Running
from .metrics_http import MetricsServer

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_THROUGHPUT_BUCKETS = tuple(float(2**i) for i in range(14, 32, 2))  # 16 KiB/s .. 1 GiB/s
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics(PullEvents, ProgressEvents, ImageEvents):
    """Every metric the shim exports, fed by the events of the packages that produce them: the
    scheduler (PullEvents), the pull-progress poller (ProgressEvents), the image calls
    (ImageEvents, HandlerEvents), intercepted calls (cri.call.CallObserver), and, loaded only when
    configured, image sets (imagesets.events.ImageSetEvents) and the cluster source
    (cluster.source_events.SourceEvents): those two are Protocols this class satisfies without
    importing them; mypy checks it where process/app.py hands the metrics over."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.pulls_total = Counter("cri_shim_pulls", "Upstream PullImage calls, by result "
                                   "(success, error, cancelled).", ["result"], registry=r)
        self.pull_requests_total = Counter("cri_shim_pull_requests", "PullImage calls received from CRI "
                                           "clients, by priority.", ["priority"], registry=r)
        self.pulls_in_flight = Gauge("cri_shim_pulls_in_flight", "Upstream pulls running now.", registry=r)
        self.pulls_running = Gauge("cri_shim_pulls_running", "Upstream pulls running now, by the class of "
                                   "caller they count against (trusted, untrusted, background; pulls.untrusted_share).",
                                   ["class"], registry=r)
        self.queue_length = Gauge("cri_shim_pull_queue_length", "Pulls waiting for a slot.", registry=r)
        self.queue_wait = Histogram("cri_shim_pull_queue_wait_seconds", "Time a pull waited for a slot "
                                    "before going upstream.", ["priority"], buckets=_WAIT_BUCKETS, registry=r)
        self.dedup_joins = Counter("cri_shim_pull_dedup_joins", "PullImage calls that joined an identical "
                                   "pull already queued or running.", registry=r)
        self.remove_denied_total = Counter("cri_shim_remove_denied", "RemoveImage calls refused because the "
                                     "image is pinned.", registry=r)
        self.handler_injected_total = Counter("cri_shim_runtime_handler_injected", "Runtime handlers set on "
                                        "image requests, by how they were chosen.", ["source"], registry=r)
        self.upstream_errors = Counter("cri_shim_upstream_errors", "Errors returned by the runtime to calls "
                                       "the shim made itself (intercepted calls and their lookups; one per "
                                       "upstream call, so a collapsed pull counts once), by method and code.",
                                       ["method", "code"], registry=r)
        self.rpc_duration = Histogram("cri_shim_rpc_duration_seconds", "Duration of intercepted CRI calls "
                                      "through the shim.", ["method", "code"], buckets=_RPC_BUCKETS, registry=r)
        self.image_set_images = Gauge("cri_shim_image_set_images", "Images of a declared image set, by state "
                                      "(declared, present, pulling, queued, failed).", ["set", "state"], registry=r)
        self.image_set_invalid = Gauge("cri_shim_image_set_invalid", "Image-set declarations whose newest version "
                                       "is refused, by source (file: files in image_sets.dir; cluster: sets); the "
                                       "last valid version of each stays in force.", ["source"], registry=r)
        self.image_set_secret_errors = Gauge("cri_shim_image_set_pull_secret_errors", "Cluster image sets naming a "
                                             "pull Secret that cannot be read or used (the set stays in force).",
                                             registry=r)
        self.image_set_disk_pressure = Gauge(
            "cri_shim_image_set_disk_pressure", "Prefetch held below kubelet's image GC threshold "
            "(image_sets.gc_threshold_guard): waiting (prefetches held; 0 when none), used_bytes of the fullest "
            "image filesystem, size_bytes of the smallest held image's manifest, threshold_bytes it may reach.",
            ["quantity"], registry=r)
        self.image_set_reconciles = Counter("cri_shim_image_set_reconciles", "Image-set reconcile passes.",
                                            registry=r)
        self.pull_bytes = Counter("cri_shim_pull_bytes", "Bytes upstream pulls downloaded into the runtime, as "
                                  "its content store reports them (each blob counted once node-wide; containerd "
                                  "only).", registry=r)
        self.pull_in_flight_bytes = Gauge("cri_shim_pull_in_flight_bytes", "Running upstream pulls whose size is "
                                          "known: bytes done and total.", ["kind"], registry=r)
        self.pull_throughput_hist = Histogram("cri_shim_pull_throughput_bytes_per_second", "Bytes an upstream pull "
                                         "downloaded divided by its running time (pulls of 1 MiB or more).",
                                         buckets=_THROUGHPUT_BUCKETS, registry=r)
        self.progress_calls = Counter("cri_shim_pull_progress_calls", "Calls the pull-progress poller made to the "
                                      "runtime's content API, by method.", ["method"], registry=r)
        self.pull_stalls = Counter("cri_shim_pull_stalls", "Upstream pulls cancelled by the stall guard "
                                   "(pulls.stall_timeout_seconds).", registry=r)
        self.pull_no_progress = Counter("cri_shim_pull_no_progress", "Upstream pulls cancelled by the no-progress "
                                        "guard (pulls.no_progress_timeout_seconds), by the phase they hung in "
                                        "(resolving, downloading).", ["phase"], registry=r)
        self.pull_slot_released = Counter("cri_shim_pull_slot_released", "Upstream pulls that went on without a "
                                          "pull slot: unanswered after pulls.no_progress_timeout_seconds while "
                                          "their progress could not be judged (e.g. CRI-O).", registry=r)
        self.cluster_state_write_failures = Counter(
            "cri_shim_cluster_state_write_failures", "Failed writes of cluster.state_file: the check at start "
            "and every save that failed (each one logged as an error).", registry=r)
        self.cluster_state_file_error = Gauge(
            "cri_shim_cluster_state_file_error", "1 while cluster.state_file cannot be written or could not be "
            "read at start (see cri-shim status: cluster.state_error), 0 once a save succeeds; pins from the "
            "cluster then do not hold after a restart while the API server is down.", registry=r)
        self.image_sets_state_write_failures = Counter(
            "cri_shim_image_sets_state_write_failures", "Failed writes of image_sets.state_file: the check at "
            "start and every save that failed (each one logged as an error).", registry=r)
        self.image_sets_state_file_error = Gauge(
            "cri_shim_image_sets_state_file_error", "1 while image_sets.state_file cannot be written or could not "
            "be read at start (see cri-shim status: image_sets.state_error), 0 once a save succeeds; a file of "
            "image_sets.dir that is invalid at a restart then loses its sets.", registry=r)
        self._rpc_children: dict[tuple[str, grpc.StatusCode], Any] = {}
        self.server: MetricsServer | None = None

    # PullEvents (the scheduler's)
    def queue_changed(self, queued: int, in_flight: int) -> None:
        self.queue_length.set(queued)
        self.pulls_in_flight.set(in_flight)

    def running_changed(self, running: Running) -> None:
        for cls, n in (("trusted", running.trusted), ("untrusted", running.untrusted),
                       ("background", running.background)):
            self.pulls_running.labels(cls).set(n)

    def flight_started(self, flight: Flight, waited: float) -> None:
        self.queue_wait.labels(flight.priority.name.lower()).observe(waited)

    def joined(self, flight: Flight) -> None:
        self.dedup_joins.inc()

    def flight_finished(self, flight: Flight, seconds: float) -> None:
        self.pulls_total.labels(flight.result or "cancelled").inc()

    def flight_released(self, flight: Flight, why: str) -> None:
        self.pull_slot_released.inc()

    # ProgressEvents (the pull-progress poller's)
    def content_called(self, method: str) -> None:
        self.progress_calls.labels(method).inc()

    def downloaded(self, nbytes: int) -> None:
        self.pull_bytes.inc(nbytes)

    def pull_throughput(self, bytes_per_second: float) -> None:
        self.pull_throughput_hist.observe(bytes_per_second)

    def in_flight_bytes(self, done: int, total: int) -> None:
        self.pull_in_flight_bytes.labels("done").set(done)
        self.pull_in_flight_bytes.labels("total").set(total)

    def pull_stalled(self) -> None:
        self.pull_stalls.inc()

    def pull_made_no_progress(self, phase: str) -> None:
        self.pull_no_progress.labels(phase).inc()

    # ImageEvents and HandlerEvents (the intercepted image calls')
    def pull_requested(self, priority: str) -> None:
        self.pull_requests_total.labels(priority).inc()

    def remove_denied(self) -> None:
        self.remove_denied_total.inc()

    def upstream_error(self, method: str, code: str) -> None:
        self.upstream_errors.labels(method, code).inc()

    def handler_injected(self, source: str) -> None:
        self.handler_injected_total.labels(source).inc()

    # imagesets.events.ImageSetEvents (invalid_declarations: cluster.source_events.SourceEvents too)
    def set_counts(self, set_name: str, counts: Mapping[str, int]) -> None:
        for state, n in counts.items():
            self.image_set_images.labels(set_name, state).set(n)

    def set_removed(self, set_name: str, states: tuple[str, ...]) -> None:
        for state in states:
            self.image_set_images.remove(set_name, state)

    def runtime_listed(self) -> None:
        self.image_set_reconciles.inc()

    def disk_pressure(self, numbers: Mapping[str, int | str] | None) -> None:
        n = numbers or {}
        for quantity, key in (("waiting", "waiting"), ("used_bytes", "usedBytes"), ("size_bytes", "sizeBytes"),
                              ("threshold_bytes", "thresholdBytes")):
            v = n.get(key, 0)
            self.image_set_disk_pressure.labels(quantity).set(v if isinstance(v, int) else 0)

    def prefetch_started(self) -> None:
        self.pull_requests_total.labels("background").inc()

    def invalid_declarations(self, source: str, count: int) -> None:
        self.image_set_invalid.labels(source).set(count)

    def image_sets_state_write_failed(self) -> None:
        self.image_sets_state_write_failures.inc()

    def image_sets_state_error(self, failing: bool) -> None:
        self.image_sets_state_file_error.set(1 if failing else 0)

    # cluster.source_events.SourceEvents
    def secret_errors(self, count: int) -> None:
        self.image_set_secret_errors.set(count)

    def cluster_state_write_failed(self) -> None:
        self.cluster_state_write_failures.inc()

    def cluster_state_error(self, failing: bool) -> None:
        self.cluster_state_file_error.set(1 if failing else 0)

    # cri.call.CallObserver (intercepted calls only: passthrough is not timed)
    def observe_call(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        child = self._rpc_children.get((method, code))
        if child is None:
            child = self._rpc_children[(method, code)] = self.rpc_duration.labels(method_label(method), code.name)
        child.observe(seconds)

    # serving
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def serve(self, address: str, max_connections: int, timeout: float) -> None:
        """Serve /metrics on the running loop; OSError when ``address`` cannot be bound."""
        host, _, port = address.rpartition(":")
        server = MetricsServer(self.render, max_connections, timeout)
        await server.start(host.strip("[]"), int(port))
        self.server = server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def method_label(method: str) -> str:
    """``/runtime.v1.ImageService/PullImage`` -> ``PullImage`` (the label value used by every metric)."""
    return method.rpartition("/")[2]
