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
import fnmatch
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from google.protobuf.message import DecodeError

from .. import reference
from ..config import ConfigError, HandlerRule, RuntimeHandlersConfig
from ..cri import protowire as wire
from ..cri.methods import LIST_POD_SANDBOX
from ..cri.upstream import Upstream
from ..errors import Metadata, RpcError, check_image_name
from ..image_patterns import normalize_pattern
from ..observability import logs
from ..proto.runtime.v1 import api_pb2

if TYPE_CHECKING:
    from ..cri.call import Call
    from ..images.service import ImageService
    from ..observability.metrics import Metrics

_log = logs.get("handlers")

IMAGE_FIELD = 1  # ImageStatusRequest.image, RemoveImageRequest.image, PullImageRequest.image
RUNTIME_HANDLER_FIELD = 19  # ImageSpec.runtime_handler
LOOKUP_TIMEOUT_SECONDS = 2.0
NEGATIVE_TTL_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Decision:
    """A handler the shim chose. ``source`` is for people, ``kind`` is a metric label."""

    handler: str
    source: str  # "runtime_handlers.rules[0]", "pod <uid> learned from RunPodSandbox", ...
    kind: str  # rule | pod | lookup


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True, slots=True)
class Rule:
    index: int
    handler: str
    namespaces: frozenset[str]
    exact_images: frozenset[str]
    image_globs: tuple[str, ...]
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]

    @property
    def needs_pod(self) -> bool:
        """Matches on something only a pod has (namespace, labels)."""
        return bool(self.namespaces or self.labels)

    @property
    def source(self) -> str:
        return f"runtime_handlers.rules[{self.index}]"

    def matches(self, names: list[str], namespace: str | None, labels: Mapping[str, str] | None,
                annotations: Iterable[Mapping[str, str]]) -> bool:
        if self.needs_pod and namespace is None:
            return False
        if self.namespaces and namespace not in self.namespaces:
            return False
        if self.exact_images or self.image_globs:
            if not any(n in self.exact_images or any(fnmatch.fnmatchcase(n, g) for g in self.image_globs)
                       for n in names):
                return False
        if labels is None and self.labels:
            return False
        for k, v in self.labels:
            if labels is None or labels.get(k) != v:
                return False
        for k, v in self.annotations:
            if _first(annotations, k) != v:
                return False
        return True


def _first(maps: Iterable[Mapping[str, str]], key: str) -> str | None:
    """The value of ``key`` in the first map that has it."""
    for m in maps:
        if key in m:
            return m[key]
    return None


def compile_rules(rules: Iterable[HandlerRule]) -> tuple[Rule, ...]:
    """Normalize image patterns the way pins do. Raises ConfigError naming the bad pattern."""
    out = []
    for i, r in enumerate(rules):
        exact: set[str] = set()
        globs: list[str] = []
        for j, p in enumerate(r.images):
            try:
                canon = normalize_pattern(p)
            except ValueError as e:
                raise ConfigError(f"runtime_handlers.rules[{i}].images[{j}]", f"{e} (got {logs.shown(p)})") from None
            if any(c in canon for c in "*?["):
                globs.append(canon)
            else:
                exact.add(canon)
        out.append(Rule(i, r.handler, frozenset(r.namespaces), frozenset(exact), tuple(globs),
                        r.pod_labels, r.pod_annotations))
    return tuple(out)


def reference_names(image: str) -> list[str]:
    """The normalized names a rule's image patterns are matched against.

    ``nginx`` -> ``docker.io/library/nginx:latest``; ``repo:tag@digest`` also as
    ``repo@digest`` and ``repo:tag``; an image ID as ``sha256:<hex>``. An unparseable
    string is matched as it is.
    """
    if reference.is_image_id(image):
        return [reference.normalize(image)]
    try:
        ref = reference.parse(image)
    except reference.InvalidReference:
        return [image]
    names = [str(ref.with_default_tag())]
    if ref.digest is not None:
        names.append(f"{ref.name}@{ref.digest}")
        if ref.tag is not None:
            names.append(f"{ref.name}:{ref.tag}")
    return names


# --------------------------------------------------------------------------- pod cache


@dataclass(slots=True)
class Pod:
    handler: str  # "" = the runtime's default handler: nothing to inject
    learned: bool  # True: from RunPodSandbox; False: from ListPodSandbox
    sandboxes: set[str] = field(default_factory=set)


class PodCache:
    """Pod UID -> handler, least recently used first out; sandbox id -> UID alongside
    (RemovePodSandbox names only the sandbox). Unknown pods are remembered until a
    deadline so a burst of pulls for them costs one lookup."""

    def __init__(self, size: int, negative_ttl: float, clock: Callable[[], float]) -> None:
        self.size = size
        self.negative_ttl = negative_ttl
        self._clock = clock
        self._pods: OrderedDict[str, Pod] = OrderedDict()
        self._uid_of: dict[str, str] = {}
        self._unknown: OrderedDict[str, float] = OrderedDict()  # uid -> remembered until

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, uid: object) -> bool:
        return uid in self._pods

    def get(self, uid: str) -> Pod | None:
        pod = self._pods.get(uid)
        if pod is not None:
            self._pods.move_to_end(uid)
        return pod

    def put(self, uid: str, sandbox_id: str, handler: str, *, learned: bool, evict: bool = True) -> bool:
        """Record a pod's sandbox. With ``evict=False`` a new pod is only added while there is room."""
        pod = self._pods.get(uid)
        if pod is None:
            if not evict and len(self._pods) >= self.size:
                return False
            pod = self._pods[uid] = Pod(handler, learned)
        elif learned or not pod.learned:
            pod.handler, pod.learned = handler, learned or pod.learned
        if sandbox_id:
            pod.sandboxes.add(sandbox_id)
            self._uid_of[sandbox_id] = uid
        self._pods.move_to_end(uid)
        self._unknown.pop(uid, None)
        self._trim()
        return True

    def forget_sandbox(self, sandbox_id: str) -> str | None:
        """Drop a removed sandbox; the pod goes once its last known sandbox has. Returns the UID."""
        uid = self._uid_of.pop(sandbox_id, None)
        if uid is None:
            return None
        pod = self._pods.get(uid)
        if pod is not None:
            pod.sandboxes.discard(sandbox_id)
            if not pod.sandboxes:
                del self._pods[uid]
        return uid

    def mark_unknown(self, uid: str) -> None:
        if uid in self._pods:
            return
        self._unknown[uid] = self._clock() + self.negative_ttl
        self._unknown.move_to_end(uid)
        while len(self._unknown) > self.size:
            self._unknown.popitem(last=False)

    def known_unknown(self, uid: str) -> bool:
        until = self._unknown.get(uid)
        if until is None:
            return False
        if self._clock() >= until:
            del self._unknown[uid]
            return False
        return True

    def resize(self, size: int) -> None:
        self.size = size
        self._trim()
        while len(self._unknown) > size:
            self._unknown.popitem(last=False)

    def _trim(self) -> None:
        while len(self._pods) > self.size:
            _, pod = self._pods.popitem(last=False)
            for sid in pod.sandboxes:
                self._uid_of.pop(sid, None)


# --------------------------------------------------------------------------- resolver


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


# --------------------------------------------------------------------------- ImageStatus / RemoveImage


def image_spec(request: bytes) -> api_pb2.ImageSpec:
    """The ImageSpec (field 1) of an ImageStatus/RemoveImage request, merged as protobuf does."""
    payload = b"".join(request[vs:end] for number, wtype, _, vs, end in wire.fields(request)
                       if number == IMAGE_FIELD and wtype == wire.LEN)
    return api_pb2.ImageSpec.FromString(payload)


def inject_image_handler(svc: ImageService, request: bytes,
                         decoded_req: api_pb2.ImageStatusRequest | api_pb2.RemoveImageRequest | None = None) -> bytes:
    """ImageStatus / RemoveImage request bytes with a rule's handler appended to ImageSpec.

    Unchanged (the same bytes) when there is no resolver, the client set a handler, or
    no rule applies. ``decoded_req`` is the request already decoded (anything with an
    ``image`` ImageSpec), to save decoding it again.
    """
    resolver = svc.handlers
    if resolver is None or not resolver.applies_to_images:
        return request
    try:
        spec = decoded_req.image if decoded_req is not None else image_spec(request)
    except (wire.WireError, DecodeError):
        return request  # malformed: the runtime (or the pins check) answers it as it is
    if spec.runtime_handler:
        return request
    check_image_name(spec.image, "ImageSpec.image")
    decision = resolver.for_image(spec)
    if decision is None:
        return request
    return inject(request, spec.image, decision, svc.metrics)


def inject(request: bytes, image: str, decision: Decision, metrics: Metrics, level: int = logging.DEBUG) -> bytes:
    """``request`` with ``decision.handler`` appended to its ImageSpec, counted
    (cri_shim_runtime_handler_injected) and logged: the one place a handler is injected."""
    metrics.handler_injected.labels(decision.kind).inc()
    logs.log(_log, level, "runtime handler injected", image=image, handler=decision.handler, source=decision.source)
    return with_runtime_handler(request, decision.handler)


def with_runtime_handler(request: bytes, handler: str) -> bytes:
    """An image request (PullImage, ImageStatus, RemoveImage) with ``handler`` appended to its
    ImageSpec; every other byte as it was."""
    return wire.append_to_submessage(request, IMAGE_FIELD, wire.string_field(RUNTIME_HANDLER_FIELD, handler))
