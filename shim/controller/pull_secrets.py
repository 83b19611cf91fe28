"""The Role that lets nodes read exactly the pull Secrets that ImageSets name (no hand-edited list).

For each namespace holding a Secret that some ImageSet names in ``spec.imagePullSecrets``, the
leader keeps a Role ``cri-shim-node-pull-secrets`` (``get, list, watch`` on those Secrets by
``resourceNames``: a node watches each by name) and a RoleBinding of it to the group
``system:nodes`` (each node's kubelet identity). A namespace no set names any more loses both:
an empty ``resourceNames`` would mean every Secret, so it is never written.

Work follows the change: an ImageSet event updates that set's references; only when the names
wanted in some namespace differ from those applied are the Role and RoleBinding applied
(server-side apply). On taking the lead, the Roles it manages (label
``app.kubernetes.io/managed-by: cri-shim-controller``) are listed once to learn what is applied.
A set whose ``imagePullSecrets`` cannot be read keeps the references of its last readable
version (nodes keep applying that version).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from kubernetes_asyncio.client import ApiClient, RbacAuthorizationV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from ..cluster.informer import Obj, describe
from ..cluster.objects import SecretRef, pull_secret_refs
from ..imagesets.loader import SetFileError
from ..observability import logs

_log = logs.get("controller")

ROLE = "cri-shim-node-pull-secrets"
NODES_GROUP = "system:nodes"
MANAGED_BY = ("app.kubernetes.io/managed-by", "cri-shim-controller")
FIELD_MANAGER = "cri-shim-controller"
RBAC = "rbac.authorization.k8s.io"


def wanted(refs: Mapping[str, tuple[SecretRef, ...]]) -> dict[str, tuple[str, ...]]:
    """Namespace -> the Secret names sets name there (sorted, never empty)."""
    out: dict[str, set[str]] = {}
    for rs in refs.values():
        for r in rs:
            out.setdefault(r.namespace, set()).add(r.name)
    return {ns: tuple(sorted(names)) for ns, names in out.items()}


def role(namespace: str, names: tuple[str, ...]) -> dict[str, Any]:
    assert names, "an empty resourceNames grants every Secret"
    return {"apiVersion": f"{RBAC}/v1", "kind": "Role",
            "metadata": {"name": ROLE, "namespace": namespace, "labels": dict([MANAGED_BY])},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(names),
                       "verbs": ["get", "list", "watch"]}]}


def binding(namespace: str) -> dict[str, Any]:
    return {"apiVersion": f"{RBAC}/v1", "kind": "RoleBinding",
            "metadata": {"name": ROLE, "namespace": namespace, "labels": dict([MANAGED_BY])},
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": ROLE},
            "subjects": [{"apiGroup": RBAC, "kind": "Group", "name": NODES_GROUP}]}


class PullSecretRoles:
    def __init__(self, api: ApiClient, *, request_timeout: float = 30.0) -> None:
        self.rbac = RbacAuthorizationV1Api(api)
        self.request_timeout = request_timeout
        self.refs: dict[str, tuple[SecretRef, ...]] = {}  # by ImageSet name
        self.applied: dict[str, tuple[str, ...]] | None = None  # by namespace; None: not read since leading
        self.dirty = True
        self.error = ""
        self.applies = 0

    # ------------------------------------------------------------------ what sets name

    def set_changed(self, name: str, obj: Obj) -> None:
        """An ImageSet added, modified (``obj``) or deleted (None)."""
        if obj is None:
            refs: tuple[SecretRef, ...] | None = ()
        else:
            try:
                refs = pull_secret_refs(obj.get("spec") or {}, f"ImageSet/{name}")
            except SetFileError:
                refs = None  # the last readable version's references stay
        if refs is None or set(self.refs.get(name, ())) == set(refs):
            return
        if refs:
            self.refs[name] = refs
        else:
            self.refs.pop(name, None)
        self.dirty = True

    def relisted(self, sets: Mapping[str, dict[str, Any]]) -> None:
        for name in [n for n in self.refs if n not in sets]:
            self.set_changed(name, None)
        for name, obj in sets.items():
            self.set_changed(name, obj)

    def lost_lead(self) -> None:
        self.applied = None
        self.dirty = True

    # ------------------------------------------------------------------ writing (leader only)

    async def sync(self) -> bool:
        """Apply what changed; True when everything wanted is applied."""
        try:
            if self.applied is None:
                self.applied = await self._read()
            want = wanted(self.refs)
            for ns, names in want.items():
                if self.applied.get(ns) != names:
                    await self._apply(role(ns, names), self.rbac.patch_namespaced_role)
                    await self._apply(binding(ns), self.rbac.patch_namespaced_role_binding)
                    logs.log(_log, logging.INFO, "nodes may read the pull Secrets sets name", namespace=ns,
                             secrets=",".join(names))
                    self.applied[ns] = names
                    self.applies += 1
            for ns in [ns for ns in self.applied if ns not in want]:
                await self._delete(self.rbac.delete_namespaced_role_binding, ns)
                await self._delete(self.rbac.delete_namespaced_role, ns)
                logs.log(_log, logging.INFO, "no set names a pull Secret here any more: nodes may read none",
                         namespace=ns)
                del self.applied[ns]
        except Exception as e:
            if describe(e) != self.error:
                logs.log(_log, logging.WARNING, "cannot update the Role of the pull Secrets nodes may read; "
                         "will retry", error=describe(e))
            self.error = describe(e)
            return False
        self.error = ""
        self.dirty = False
        return True

    async def _read(self) -> dict[str, tuple[str, ...]]:
        resp = await self.rbac.list_role_for_all_namespaces(label_selector="=".join(MANAGED_BY),
                                                            _request_timeout=self.request_timeout)
        out = {}
        for r in resp.items:
            if r.metadata.name == ROLE:
                names = [n for rule in r.rules or [] for n in rule.resource_names or []]
                out[r.metadata.namespace] = tuple(sorted(names))
        return out

    async def _apply(self, body: dict[str, Any], patch: Any) -> None:
        meta = body["metadata"]
        await patch(meta["name"], meta["namespace"], body, field_manager=FIELD_MANAGER, force=True,
                    _content_type="application/apply-patch+yaml", _request_timeout=self.request_timeout)

    async def _delete(self, delete: Any, namespace: str) -> None:
        try:
            await delete(ROLE, namespace, _request_timeout=self.request_timeout)
        except ApiException as e:
            if e.status != 404:
                raise
