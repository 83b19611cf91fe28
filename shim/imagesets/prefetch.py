"""One prefetch: which runtime handler, which credentials, and how the pull ended.

The handler is the one the image's set declares, else the first ``runtime_handlers.rules``
entry that matches the image without a pod (``handler_for``), else none. With a handler the
request carries a minimal ``sandbox_config`` (containerd reads the handler only then).
Credentials come from shim/credentials/prefetch.py; when several entries match, each is
tried in turn until one pull succeeds, as kubelet does. Before each next try they are read again
for the image's sets as they are then: a set removed meanwhile, or deleted and created again (a new
object, a new pull secret), never lends the old one its credential; at most as many tries as
the first read found. The pull goes through the node-wide
scheduler at background priority, so the scheduler's join rule applies: a prefetch joins a
trusted CRI client's pull of the same image and handler whatever its credentials, never an
untrusted client's. Each prefetch waits for its pull at most ``image_sets.pull_timeout_seconds``
(queued and running): then it fails, naming the key, and is retried.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from ..config import ImageSetsConfig
from ..credentials.keyring import Credential
from ..credentials.prefetch import PrefetchCredentials
from ..cri.deadline import Deadline
from ..cri.methods import PULL_IMAGE
from ..cri.upstream import Upstream
from ..errors import RpcError
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from ..pulls.key import pull_key
from ..pulls.scheduler import PullScheduler
from ..pulls.slots import Priority
from .events import ImageSetEvents
from .table import DeclaredImage

_log = logs.get("imagesets")

HandlerFor = Callable[[str], "tuple[str, str] | None"]  # image -> (handler, where the rule is), or None
PREFETCH_POD = api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(
    name="cri-shim-prefetch", uid="cri-shim-prefetch", namespace="cri-shim"))


@dataclass(frozen=True)
class Pulled:
    """How one prefetch ended."""
    error: RpcError | None  # None: the image is in the runtime now
    handler: str
    handler_source: str  # image set, the rule, or none
    credentials: str  # where the last credentials tried came from ("none": anonymous)
    joined: bool  # it joined a pull already running (a CRI client's, or another prefetch's)
    seconds: float


class Prefetch:
    def __init__(self, cfg: ImageSetsConfig, upstream: Upstream, scheduler: PullScheduler,
                 credentials: PrefetchCredentials, events: ImageSetEvents,
                 handler_for: HandlerFor | None = None) -> None:
        self.cfg = cfg  # the reconciler's (Reconciler.configure keeps it current)
        self.upstream = upstream
        self.scheduler = scheduler
        self.credentials = credentials
        self._events = events
        self._handler_for = handler_for
        self.started = 0  # pulls started since the shim started

    def handler_of(self, img: DeclaredImage) -> tuple[str, str]:
        """(handler, where it came from) for this pull: the set's, else a rule's, else none."""
        if img.handler:
            return img.handler, "image set"
        if self._handler_for is not None:
            decision = self._handler_for(img.spelled)
            if decision is not None:
                return decision
        return "", "none"

    async def pull(self, img: DeclaredImage) -> Pulled:
        """Pull ``img`` once, trying each matching credential until one succeeds."""
        handler, handler_source = self.handler_of(img)
        attempts = await self.credentials.for_image(img.spelled, frozenset(img.sets))
        tries = len(attempts)
        tried: list[Credential | None] = []
        self.started += 1
        self._events.prefetch_started()
        t0 = time.monotonic()
        error: RpcError | None = None
        joined = False
        cred = None
        while attempts:
            cred = attempts[0]
            tried.append(cred)
            req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=img.spelled, runtime_handler=handler))
            if cred is not None:
                req.auth.CopyFrom(cred.auth_config())
            if handler:  # containerd honours ImageSpec.runtime_handler only with a sandbox_config
                req.sandbox_config.CopyFrom(PREFETCH_POD)
            request = req.SerializeToString()

            async def run(request: bytes = request) -> bytes:
                return await self.upstream.unary(PULL_IMAGE, request)

            key = pull_key(req, handler)
            try:
                outcome = await self.scheduler.pull(key, run, priority=Priority.BACKGROUND,
                                                    deadline=Deadline.after(self.cfg.pull_timeout_seconds))
            except RpcError as e:
                error = e
                if e.code is grpc.StatusCode.DEADLINE_EXCEEDED and not e.from_upstream:  # ours: name the key
                    error = RpcError(e.code, f"{e.details} (image_sets.pull_timeout_seconds: "
                                             f"{self.cfg.pull_timeout_seconds:g} s)")
                    break
                if e.code is grpc.StatusCode.CANCELLED or len(tried) >= tries:
                    break
                # the next of those the image's sets give now (its sets may have changed meanwhile)
                current = await self.credentials.for_image(img.spelled, frozenset(img.sets))
                attempts = [c for c in current if c not in tried]
                if attempts:
                    logs.log(_log, logging.INFO, "image set pull failed with these credentials; trying the next",
                             image=img.ref, credentials=cred.source if cred else "none", code=e.code.name)
                continue
            error, joined = None, outcome.joined
            break
        return Pulled(error, handler, handler_source, cred.source if cred else "none", joined, time.monotonic() - t0)
