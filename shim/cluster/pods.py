"""The priority of the pods bound to this node, as the API server has them (``spec.priority``).

One list + watch of ``/api/v1/pods`` with ``fieldSelector spec.nodeName=<node>,
status.phase!=Succeeded,status.phase!=Failed``: the pods kubelet runs or is about to run here,
what kubelet itself watches. The Node authorizer lets ``system:node:<node>`` list and watch
pods with exactly that ``spec.nodeName`` (other requirements beside it are allowed), so the
kubelet's own kubeconfig needs no RBAC for it; a ServiceAccount identity needs ``list, watch``
on pods, which RBAC cannot narrow to one node (docs/node-identity.md). A pod that finishes
leaves the watch (the server sends DELETED when it stops matching), so completed Jobs do not
accumulate.

Kept per pod, by uid: its namespace, name and ``spec.priority`` (the Priority admission plugin
sets it from ``priorityClassName``; absent where that plugin is off). Everything else of the
decoded object is dropped as soon as it is read. Bound: ``cluster.max_pods`` pods (default
1000; kubelet's ``maxPods`` defaults to 110), about 0.3 KiB each with 40-character names; a pod
beyond it is not kept (``not_kept`` in status) and its priority is unknown.

``priority_of(namespace, name, uid)``: by uid, else by namespace/name (a static pod: the uid in
its sandbox is kubelet's, its mirror pod's is the API server's). None when the pod is not known,
has no ``spec.priority``, or while the watch is not synced or failing (API server unreachable):
callers then fall back to their rules, for every pod alike. A 403 (a ServiceAccount identity
without ``list`` on pods, or a kubelet identity of another node) ends the watch: one request, one
warning, ``refused`` in status, every answer None until the shim restarts or a reload changes a
``cluster`` key (which starts the cluster source again).
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes_asyncio.client import ApiClient

from ..observability import logs
from .informer import Informer, ListFn, Obj

_log = logs.get("cluster")


def field_selector(node_name: str) -> str:
    """The pods bound to ``node_name`` that have not finished."""
    return f"spec.nodeName={node_name},status.phase!=Succeeded,status.phase!=Failed"


def _uid(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta['name']}")


def _keep(obj: dict[str, Any]) -> dict[str, Any]:
    """What a pod's priority needs; nothing else of it is stored."""
    meta, prio = obj["metadata"], (obj.get("spec") or {}).get("priority")
    return {"uid": _uid(obj), "namespace": str(meta.get("namespace") or ""), "name": str(meta["name"]),
            "priority": prio if isinstance(prio, int) and not isinstance(prio, bool) else None}


class NodePods:
    """The pods bound to ``node_name``: ``priority_of`` for the pull queue, ``status`` for `cri-shim status`.
    ``run`` watches them until cancelled (ClusterSource.start runs it, stop cancels it)."""

    def __init__(self, api: ApiClient, list_pods: ListFn, node_name: str, *, max_pods: int,
                 **common: Any) -> None:
        self.node_name = node_name
        self.max_pods = max_pods
        self._by_name: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid
        self.refused = False  # the API server answered 403: not asked again
        self.informer = Informer(api, "pods", list_pods, **{**common, "on_change": _nothing},
                                 on_event=self._event, key=_uid, shrink=_keep, max_items=max_pods,
                                 give_up_on=frozenset({403}), field_selector=field_selector(node_name))

    async def run(self) -> None:
        """Watch until cancelled, or until the API server refuses (403)."""
        await self.informer.run()
        self.refused = True
        logs.log(_log, logging.WARNING, "cannot list the pods bound to this node: pulls are ordered by the "
                 "config's rules, not the pods' priority, until the shim restarts (kubelet's identity may list "
                 "them; a ServiceAccount needs list, watch on pods, see docs/node-identity.md; "
                 "cluster.pod_priority: false does not ask)", node=self.node_name, error=self.informer.error)

    def _event(self, kind: str, old: Obj, new: Obj) -> None:
        if kind == "LIST":
            self._by_name = {(p["namespace"], p["name"]): uid for uid, p in self.informer.items.items()}
        elif new is not None:
            self._by_name[(new["namespace"], new["name"])] = new["uid"]
        elif old is not None and self._by_name.get((old["namespace"], old["name"])) == old["uid"]:
            del self._by_name[(old["namespace"], old["name"])]

    @property
    def known(self) -> bool:
        """Whether the answers are the API server's: listed, and the watch not failing."""
        return self.informer.synced and not self.informer.error

    def priority_of(self, namespace: str, name: str, uid: str) -> int | None:
        """The pod's ``spec.priority``; None = unknown (not known, no priority, API not answering)."""
        if not self.known:
            return None
        items = self.informer.items
        pod = items.get(uid) if uid else None
        if pod is None:
            other = self._by_name.get((namespace, name))
            pod = items.get(other) if other is not None else None
        if pod is None:
            return None
        prio: int | None = pod["priority"]
        return prio

    def status(self) -> dict[str, Any]:
        inf = self.informer
        out: dict[str, Any] = {"synced": inf.synced, "answering": self.known, "pods": len(inf.items),
                               "max_pods": self.max_pods}
        if inf.not_kept:
            out["not_kept"] = inf.not_kept
        if self.refused:
            out["refused"] = True
        if inf.error:
            out["error"] = inf.error
        return out


def _nothing() -> None:
    """A pod's change changes no image set: nothing to recompute."""
