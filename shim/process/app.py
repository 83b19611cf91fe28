"""Wiring: builds every component from the config, owns the interception table,
and applies reloads.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .. import config as config_mod
from ..config import Config, ConfigError
from ..cri.call import Handler, Observation
from ..cri.methods import (
    IMAGE_STATUS,
    LIST_IMAGES,
    PULL_IMAGE,
    REMOVE_IMAGE,
    REMOVE_POD_SANDBOX,
    RUN_POD_SANDBOX,
    STREAM_IMAGES,
    canonical,
)
from ..cri.routing import Patch, Router
from ..cri.upstream import Upstream
from ..images import image_status, list_images, pull_image, remove_image
from ..images.service import ImageService
from ..observability.metrics import Metrics
from ..observability.tracing import Tracing
from ..pins.ledger import PinLedger
from ..pulls.lease import SlotLease
from ..pulls.pod_priority import PodPriority
from ..pulls.poller import ProgressPoller
from ..pulls.scheduler import PullScheduler
from ..relay.listener import Relay
from ..runtime_handlers.resolver import HandlerResolver
from ..runtime_handlers.rules import compile_rules
from ..runtime_handlers.sandboxes import remove_pod_sandbox, run_pod_sandbox
from .admin import AdminServer
from .status_document import StatusSource, collect

if TYPE_CHECKING:  # imported only when configured (docs/performance.md, "Memory at rest"): the
    # Kubernetes client only with cluster.kubeconfig (seconds, about 45 MiB), image sets (and the
    # credential readers) only with image_sets.dir or cluster.kubeconfig
    from ..cluster.node_report import NodeReport
    from ..cluster.source import ClusterSource
    from ..credentials import Credential
    from ..imagesets.manager import ImageSets


class App:
    """Every component of a running shim, created once per process."""

    def __init__(self, cfg: Config, tracing: Tracing | None = None) -> None:
        """Every part is built complete from ``cfg``. Raises ConfigError on a value only a part can check."""
        self.cfg = cfg
        self.started_at = time.monotonic()
        self.tracing = tracing if tracing is not None else Tracing.from_env(route=canonical)
        self.admin: AdminServer | None = None
        self.metrics = Metrics()
        self.upstream = Upstream(cfg.upstream, cfg.server.max_message_bytes)
        p = cfg.pulls
        self.scheduler = PullScheduler(p.max_parallel, cfg.image_sets.max_parallel, dedup=p.dedup,
                                       untrusted_share=p.untrusted_share, max_parallel_per_uid=p.max_parallel_per_uid,
                                       priority_order=p.priority_order, aging_seconds=p.priority_aging_seconds,
                                       critical_slots=p.critical_slots, observers=[self.metrics])
        # a trusted pull's pod priority: pulls.priority_rules until the cluster source's lookup is given (use_lookup)
        self.pod_priority = PodPriority(p.priority_rules)
        # the progress poller and the slot lease follow the scheduler's events from their construction on
        self.progress = ProgressPoller(self.upstream, self.scheduler, self.metrics, p)
        self.lease = SlotLease(self.scheduler, self.progress.unjudged, p.no_progress_timeout_seconds)
        self.handlers = HandlerResolver(self.upstream, cfg.runtime_handlers)
        try:
            self.images = ImageService(self.upstream, self.scheduler, self.metrics, handlers=self.handlers,
                                       pod_priority=self.pod_priority,
                                       tracing=self.tracing, pin_patterns=tuple(cfg.pins.images),
                                       pins_enforce=cfg.pins.mode == "enforce",
                                       dedup_per_namespace=p.dedup_per_namespace,
                                       pins_wait_seconds=cfg.image_sets.pins_wait_seconds)
        except ValueError as e:
            raise ConfigError("pins.images", str(e)) from None
        # The node's pin ledger: loaded at start (before serving), kept across reloads, whatever image sets do.
        self.ledger = PinLedger(cfg.pins.ledger_file)
        self.image_sets: ImageSets | None = None
        self.cluster: ClusterSource | None = None
        self.node_report: NodeReport | None = None
        # The interception table, looked up once per call by either engine (as the runtime routes it).
        self.router: Router[Handler] = Router(self.table(), cfg.server.allowed_services)
        self.observation = Observation(self.metrics.observe_call, self.tracing)
        # The engine that serves CRI clients (server.engine): built here, started by process/server.py.
        self.relay = (Relay(config_mod.socket_path(cfg.upstream), self.upstream, self.router, cfg.server,
                            observe=self.observation.observe) if cfg.server.engine == "relay" else None)
        # `cri-shim status` sections beyond the built-in ones: name -> () -> JSON-able dict, no credentials.
        self.status_sources: dict[str, StatusSource] = {"image_sets": self.image_sets_status,
                                                        "cluster": self.cluster_status,
                                                        "pin_ledger": self.ledger.status}
        if self.relay is not None:
            self.status_sources["relay"] = self.relay.status

    def _configure(self, cfg: Config) -> None:
        """Apply the reloadable parts of ``cfg``. Raises ConfigError before changing anything."""
        handler_rules = compile_rules(cfg.runtime_handlers.rules)
        try:
            self.images.configure(cfg.pins.images, pins_enforce=cfg.pins.mode == "enforce",
                                  dedup_per_namespace=cfg.pulls.dedup_per_namespace,
                                  pins_wait_seconds=cfg.image_sets.pins_wait_seconds)
        except ValueError as e:
            raise ConfigError("pins.images", str(e)) from None
        self.handlers.configure(cfg.runtime_handlers, handler_rules)
        self.cfg = cfg
        self.scheduler.configure(cfg.pulls.max_parallel, cfg.image_sets.max_parallel, cfg.pulls.dedup,
                                 untrusted_share=cfg.pulls.untrusted_share,
                                 max_parallel_per_uid=cfg.pulls.max_parallel_per_uid,
                                 priority_order=cfg.pulls.priority_order,
                                 aging_seconds=cfg.pulls.priority_aging_seconds,
                                 critical_slots=cfg.pulls.critical_slots)
        self.pod_priority.configure(cfg.pulls.priority_rules)
        self.progress.configure(cfg.pulls)
        self.lease.configure(cfg.pulls.no_progress_timeout_seconds)

    def declare_pins(self, declared: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        """The pins of the declared image sets changed (ref -> set name, or pairs): the image service
        and the interception table (which intercepts image listing only while something pins) take them."""
        self.images.set_declared_pins(declared)
        self.router.set_table(self.table())

    def table(self) -> dict[str, Handler | Patch[Handler]]:
        """Interception table: full method name -> handler, or a Patch (relayed, the response
        rewritten: the relay engine marks pins in ImageStatus/ListImages answers that way).
        Everything else passes through."""
        svc = self.images
        table: dict[str, Handler | Patch[Handler]] = {
            PULL_IMAGE: partial(pull_image.pull_image, svc),
        }
        if svc.pins:  # without pins these calls are relayed untouched
            table |= {
                LIST_IMAGES: Patch(LIST_IMAGES, partial(list_images.list_images, svc),
                                   partial(list_images.mark_list, svc)),
                STREAM_IMAGES: partial(list_images.stream_images, svc),
            }
        # pins, image sets (which may pin, from their first scan on), or a rule may add a runtime handler
        # a runtime_handlers rule that applies to images rewrites ImageStatus's *request*: intercepted then
        rewrites_requests = self.handlers.applies_to_images
        if svc.pins or self.cfg.image_sets.dir or rewrites_requests:
            status_handler: Handler = partial(image_status.image_status, svc)
            table |= {
                REMOVE_IMAGE: partial(remove_image.remove_image, svc),
                IMAGE_STATUS: (status_handler if rewrites_requests
                               else Patch(IMAGE_STATUS, status_handler, partial(image_status.mark, svc))),
            }
        if self.handlers.learn:
            table[RUN_POD_SANDBOX] = partial(run_pod_sandbox, self.handlers)
            table[REMOVE_POD_SANDBOX] = partial(remove_pod_sandbox, self.handlers)
        return table

    async def _apply_image_sets(self, cfg: Config) -> None:
        """Start, stop or reconfigure image sets; a new image_sets.dir means starting over.

        With ``cluster.kubeconfig`` the cluster is a second source of sets. Both state files
        (``image_sets.state_file``, ``cluster.state_file``) are loaded here, before the shim
        serves, so their pins hold from the first call."""
        current = self.image_sets
        wanted = bool(cfg.image_sets.dir or cfg.cluster.kubeconfig)
        if (current is not None and wanted and current.cfg.dir == cfg.image_sets.dir
                and current.cfg.state_file == cfg.image_sets.state_file):
            current.configure(cfg.image_sets)
            if self.cluster is None or self.cluster.cfg != cfg.cluster:
                await self._stop_cluster()
                await self._start_cluster(cfg)
            return
        await self._stop_cluster()
        if current is not None:
            self.image_sets = None
            await current.stop()  # the ledger's pins stay in force, with image sets off too
        if wanted:
            from ..imagesets.manager import ImageSets

            if cfg.image_sets.dir:  # the directory's first read sets the pins and opens the gate; the
                self.images.expect_declared_pins()  # cluster's state file is read before serving (below)
            self.image_sets = ImageSets(cfg.image_sets, self.upstream, self.scheduler, self.metrics,
                                        on_pins=self.declare_pins, ledger=self.ledger, pins=lambda: self.images.pins,
                                        handler_for=self.handlers.for_prefetch, set_credentials=self._set_credentials)
            self.image_sets.load_state()
            await self._start_cluster(cfg)
            await self.image_sets.start()

    def _set_credentials(self, set_names: frozenset[str]) -> list[tuple[str, Credential]]:
        """Image-set prefetch: the pull secrets of cluster sets (a set's own, before the node's)."""
        return self.cluster.credentials_for(set_names) if self.cluster is not None else []

    async def _start_cluster(self, cfg: Config) -> None:
        if not cfg.cluster.kubeconfig or self.image_sets is None:
            return
        from ..cluster.node_report import NodeReport
        from ..cluster.source import ClusterSource

        c = cfg.cluster
        self.cluster = ClusterSource(c, self.image_sets, self.metrics, parser=self.image_sets.parser)
        self.cluster.load_state()
        await self.cluster.start()
        self.pod_priority.use_lookup(self.cluster)  # the pods bound to this node (cluster.pod_priority)
        self.node_report = NodeReport(self.cluster, self.image_sets, self.progress, interval=c.status_interval_seconds,
                                      event_interval=c.event_interval_seconds, event_namespace=c.event_namespace,
                                      request_timeout=c.request_timeout_seconds, max_rows=c.status_max_rows,
                                      event_burst=c.event_burst)
        self.node_report.start()

    async def _stop_cluster(self) -> None:
        if self.node_report is not None:
            await self.node_report.stop()
            self.node_report = None
        if self.cluster is not None:
            self.pod_priority.use_lookup(None)
            await self.cluster.stop()
            self.cluster = None

    def image_sets_status(self) -> dict[str, object]:
        """Status source for `cri-shim status`."""
        if self.image_sets is None:
            return {"enabled": False}
        return {"enabled": True, **self.image_sets.status()}

    def cluster_status(self) -> dict[str, object]:
        """Status source for `cri-shim status`."""
        if self.cluster is None:
            return {"enabled": False}
        return {"enabled": True, **self.cluster.status(),
                **({"status_object": self.node_report.status()} if self.node_report is not None else {})}

    async def start(self) -> None:
        self.upstream.start_watch()
        if self.cfg.metrics.address:
            m = self.cfg.metrics  # OSError: ShimServer.start reports it
            await self.metrics.serve(m.address, m.max_connections, m.timeout_seconds)
        if self.cfg.server.admin_socket:
            self.admin = AdminServer(self.cfg.server.admin_socket, self.status)
            await self.admin.start()
        self.ledger.load()  # before serving: the pins of every set in the ledger hold from the first call
        if len(self.ledger):
            self.declare_pins(self.ledger.snapshot())
        await self._apply_image_sets(self.cfg)

    def status(self) -> dict[str, Any]:
        """The `cri-shim status` document."""
        return collect(self.cfg, self.scheduler, self.progress, self.upstream, self.tracing, self.status_sources,
                       self.started_at)

    async def reload(self, cfg: Config) -> None:
        self._configure(cfg)
        self.ledger.relocate(cfg.pins.ledger_file)
        self.ledger.schedule_save()
        self.router.set_table(self.table())
        self.router.set_allowed_services(cfg.server.allowed_services)
        await self._apply_image_sets(cfg)

    def begin_shutdown(self) -> None:
        """SIGTERM: queued pulls fail with UNAVAILABLE so kubelet retries; running ones may finish."""
        if self.image_sets is not None:
            self.image_sets.halt()
        self.scheduler.close()

    async def close(self) -> None:
        await self._stop_cluster()
        if self.image_sets is not None:
            await self.image_sets.stop()
        await self.ledger.flush()
        await self.progress.close()
        if self.admin is not None:
            await self.admin.close()
        self.metrics.close()
        await self.upstream.close()
        await self.tracing.aclose()  # export the last spans, for a few seconds at most
