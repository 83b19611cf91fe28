"""The pods whose runtime handler the shim knows: pod UID -> handler, learned from
RunPodSandbox or found by ListPodSandbox, bounded by ``runtime_handlers.pod_cache_size``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable


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
