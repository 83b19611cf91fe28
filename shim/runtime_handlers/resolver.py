"""Runtime handlers for image requests (KEP-4216: image pull per runtime class).

A runtime such as containerd 2.x picks the snapshotter (and platform) for a pull from
``ImageSpec.runtime_handler``. kubelet only sends it behind an alpha feature gate, so
the shim can supply it. For a PullImage that carries no handler, in order:

1. ``runtime_handlers.rules``: the first rule whose matchers all match (namespace,
   image glob on the normalized reference, pod labels, pod annotations).
2. The pod's own handler, learned from a successful RunPodSandbox (pod UID -> handler;
   RemovePodSandbox forgets it).
3. For a pod the shim has not seen: one ListPodSandbox call (caller's metadata, short
   timeout), matched on ``metadata.uid`` here. Concurrent lookups for the same pod share
   that call; a pod that is not found is remembered as unknown for a few seconds.

A handler the client sent is never replaced, and a pod the shim cannot find gets none.
ImageStatus and RemoveImage carry no pod: only rules without pod matchers (images,
annotations from ImageSpec) apply to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from google.protobuf.message import DecodeError

from ..config import RuntimeHandlersConfig
from ..cri.methods import LIST_POD_SANDBOX
from ..cri.upstream import Upstream
from ..errors import Metadata, RpcError
from ..observability import logs
from ..proto.runtime.v1 import api_pb2
from .decision import Decision
from .pods import Pod, PodCache
from .rules import Rule, compile_rules, reference_names

if TYPE_CHECKING:
    from ..cri.call import Call

_log = logs.get("handlers")

LOOKUP_TIMEOUT_SECONDS = 2.0
NEGATIVE_TTL_SECONDS = 5.0


class HandlerResolver:
    """Chooses the runtime handler for image requests. One per process."""

    def __init__(self, upstream: Upstream, cfg: RuntimeHandlersConfig | None = None, *,
                 negative_ttl: float = NEGATIVE_TTL_SECONDS, lookup_timeout: float = LOOKUP_TIMEOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cfg = cfg or RuntimeHandlersConfig()
        self.upstream = upstream
        self.lookup_timeout = lookup_timeout
        self.rules: tuple[Rule, ...] = compile_rules(cfg.rules)
        self.learn = cfg.learn_from_sandboxes
        self.pods = PodCache(cfg.pod_cache_size, negative_ttl, clock)
        self._inflight: dict[str, asyncio.Task[Pod | None]] = {}

    def configure(self, cfg: RuntimeHandlersConfig, rules: tuple[Rule, ...] | None = None) -> None:
        """Apply a reloaded config (``rules``: already compiled from it); the pod cache is kept.
        Raises ConfigError before changing anything."""
        rules = compile_rules(cfg.rules) if rules is None else rules
        self.rules, self.learn = rules, cfg.learn_from_sandboxes
        self.pods.resize(cfg.pod_cache_size)

    @property
    def applies_to_images(self) -> bool:
        """Some rule can match ImageStatus / RemoveImage (one without pod matchers)."""
        return any(not r.needs_pod for r in self.rules)

    # ---- deciding

    def match_rule(self, image: str, namespace: str | None, labels: Mapping[str, str] | None,
                   annotations: Iterable[Mapping[str, str]]) -> Decision | None:
        if not self.rules:
            return None
        names = reference_names(image)
        annotations = tuple(annotations)
        for rule in self.rules:
            if rule.matches(names, namespace, labels, annotations):
                return Decision(rule.handler, rule.source, "rule")
        return None

    async def for_pull(self, req: api_pb2.PullImageRequest, call: Call) -> Decision | None:
        """The handler for a PullImage that carries none, or None (send it as it is)."""
        has_pod = req.HasField("sandbox_config")
        sc = req.sandbox_config
        decision = self.match_rule(
            req.image.image,
            sc.metadata.namespace if has_pod else None,
            sc.labels if has_pod else None,
            (sc.annotations, req.image.annotations),  # the pod's value first, then ImageSpec's
        )
        if decision is not None or not self.learn or not has_pod:
            return decision
        uid = sc.metadata.uid
        if not uid:
            return None
        pod = self.pods.get(uid)
        if pod is None:
            pod = await self._lookup(uid, call)
        if pod is None or not pod.handler:
            return None
        if pod.learned:
            return Decision(pod.handler, f"pod {uid} learned from RunPodSandbox", "pod")
        return Decision(pod.handler, f"pod {uid} via ListPodSandbox", "lookup")

    def for_prefetch(self, image: str) -> tuple[str, str] | None:
        """Image-set prefetch: (handler, rule) of the first rule matching the image without a pod."""
        decision = self.match_rule(image, None, None, ())
        return (decision.handler, decision.source) if decision is not None else None

    def for_image(self, spec: api_pb2.ImageSpec) -> Decision | None:
        """ImageStatus / RemoveImage: rules without pod matchers, annotations from ImageSpec."""
        return self.match_rule(spec.image, None, None, (spec.annotations,))

    # ---- learning (RunPodSandbox / RemovePodSandbox)

    def learned(self, uid: str, sandbox_id: str, handler: str) -> None:
        self.pods.put(uid, sandbox_id, handler, learned=True)
        logs.log(_log, logging.DEBUG, "pod handler learned", uid=uid, sandbox=sandbox_id, handler=handler)

    def sandbox_removed(self, sandbox_id: str) -> None:
        uid = self.pods.forget_sandbox(sandbox_id)
        if uid is not None:
            logs.log(_log, logging.DEBUG, "pod sandbox forgotten", uid=uid, sandbox=sandbox_id)

    # ---- lookup

    async def _lookup(self, uid: str, call: Call) -> Pod | None:
        if self.pods.known_unknown(uid):
            return None
        task = self._inflight.get(uid)
        if task is None:
            timeout = self.lookup_timeout
            remaining = call.time_remaining()
            if remaining is not None:
                timeout = max(0.0, min(timeout, remaining))
            task = asyncio.get_running_loop().create_task(self._list(uid, call.metadata, timeout),
                                                          name=f"pod-lookup-{uid}")
            self._inflight[uid] = task
            task.add_done_callback(lambda t: self._inflight.pop(uid) if self._inflight.get(uid) is t else None)
        # shield: a caller that gives up does not cancel the lookup the others wait for
        return await asyncio.shield(task)

    async def _list(self, uid: str, metadata: Metadata, timeout: float) -> Pod | None:
        try:
            raw = await self.upstream.unary(LIST_POD_SANDBOX, b"", metadata=metadata, timeout=timeout)
            items = api_pb2.ListPodSandboxResponse.FromString(raw).items
        except RpcError as e:
            logs.log(_log, logging.WARNING, "pod lookup failed; no runtime handler from the pod", uid=uid,
                     code=e.code.name, error=e.details)
            self.pods.mark_unknown(uid)
            return None
        except DecodeError:
            logs.log(_log, logging.WARNING, "pod lookup failed: cannot parse ListPodSandboxResponse", uid=uid)
            self.pods.mark_unknown(uid)
            return None
        self._remember(uid, items)
        pod = self.pods.get(uid)
        if pod is None:
            self.pods.mark_unknown(uid)
            logs.log(_log, logging.INFO, "pod not found by ListPodSandbox; no runtime handler", uid=uid,
                     sandboxes=len(items))
        else:
            logs.log(_log, logging.INFO, "pod found by ListPodSandbox", uid=uid, handler=pod.handler,
                     sandboxes=len(items))
        return pod

    def _remember(self, uid: str, items: Iterable[api_pb2.PodSandbox]) -> None:
        """Cache the wanted pod, and the other pods listed while there is room (they are
        likely to pull next, e.g. after a shim restart)."""
        by_uid: dict[str, list[api_pb2.PodSandbox]] = {}
        for s in items:
            if s.metadata.uid:  # matched here: the request carried no filter to trust
                by_uid.setdefault(s.metadata.uid, []).append(s)
        for other, sandboxes in by_uid.items():
            if other != uid and other not in self.pods:
                _put_listed(self.pods, other, sandboxes, evict=False)
        if uid in by_uid:
            _put_listed(self.pods, uid, by_uid[uid], evict=True)


def _put_listed(cache: PodCache, uid: str, sandboxes: list[api_pb2.PodSandbox], *, evict: bool) -> None:
    # The ready sandbox, else the newest, says which handler the pod runs with.
    best = max(sandboxes, key=lambda s: (s.state == api_pb2.SANDBOX_READY, s.created_at))
    if not cache.put(uid, best.id, best.runtime_handler, learned=False, evict=evict):
        return
    for s in sandboxes:
        cache.put(uid, s.id, best.runtime_handler, learned=False)
