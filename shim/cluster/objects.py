"""The API objects the cluster source reads and writes, and which of them apply to this node.

Read:
* ``ImageSet`` (``cri-shim.io/v1``, cluster-scoped, ``deploy/cluster/crds.yaml``): the file
  format's spec (images, pin, runtimeHandler) plus ``nodeSelector`` (a LabelSelector; absent =
  every node), ``imagePullSecrets`` (``[{namespace, name}]``, ``kubernetes.io/dockerconfigjson``)
  and ``roleOverrides`` (``[{nodeSelector, maxParallel, cooldownSeconds}]``).
* ``PinnedImageSet`` (``machineconfiguration.openshift.io/v1``, else ``v1alpha1``) applied when a
  ``MachineConfigPool`` whose ``spec.nodeSelector`` matches this node's labels lists it in
  ``spec.pinnedImageSets[].name``, as MCO does.
* This node's ``Node`` (its labels).

Written: ``NodeImageSetStatus`` (``cri-shim.io/v1``, cluster-scoped, named after the node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..imagesets.loader import (
    HANDLER_ANNOTATION,
    ImageSet,
    SetFileError,
    parse_document,
)


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


IMAGE_SET = Kind("cri-shim.io", "v1", "imagesets", "ImageSet")
NODE_STATUS = Kind("cri-shim.io", "v1", "nodeimagesetstatuses", "NodeImageSetStatus")
PINNED_IMAGE_SETS = (Kind("machineconfiguration.openshift.io", "v1", "pinnedimagesets", "PinnedImageSet"),
                     Kind("machineconfiguration.openshift.io", "v1alpha1", "pinnedimagesets", "PinnedImageSet"))
MACHINE_CONFIG_POOL = Kind("machineconfiguration.openshift.io", "v1", "machineconfigpools", "MachineConfigPool")
PINNED_REPORT = Kind("cri-shim.io", "v1", "pinnedimagesetreports", "PinnedImageSetReport")  # by cri-shim controller
FIELD_MANAGER = "cri-shim"
DOCKER_CONFIG_JSON = "kubernetes.io/dockerconfigjson"
CLUSTER_ONLY_SPEC = ("nodeSelector", "imagePullSecrets", "roleOverrides", "rollout")
MAX_PULL_SECRETS = 16  # per ImageSet: the CRD's imagePullSecrets maxItems, checked here too (a CRD can be older)


class SelectorError(ValueError):
    pass


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str], *, none_selects_all: bool) -> bool:
    """A metav1.LabelSelector against a node's labels. ``{}`` selects every node."""
    if selector is None:
        return none_selects_all
    if not isinstance(selector, Mapping):
        raise SelectorError("a label selector must be a map")
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    return all(_expression(i, expr, labels) for i, expr in enumerate(selector.get("matchExpressions") or []))


def _expression(i: int, expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = str(expr.get("key")), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise SelectorError(f"matchExpressions[{i}].operator: unknown operator {op!r}")


def check_selector(selector: Mapping[str, Any] | None) -> None:
    """Raise SelectorError when any part of the selector is invalid (``selects`` stops at the first miss)."""
    if selector is None:
        return
    if not isinstance(selector, Mapping):
        raise SelectorError("a label selector must be a map")
    for i, expr in enumerate(selector.get("matchExpressions") or []):
        _expression(i, expr, {})


@dataclass(frozen=True)
class SecretRef:
    namespace: str
    name: str


def pull_secret_refs(spec: Mapping[str, Any], where: str) -> tuple[SecretRef, ...]:
    """The Secrets an ImageSet's ``spec.imagePullSecrets`` names; SetFileError when unusable."""
    refs = spec.get("imagePullSecrets") or []
    if isinstance(refs, list) and len(refs) > MAX_PULL_SECRETS:
        raise SetFileError(f"{where}.spec.imagePullSecrets: {len(refs)} entries, at most {MAX_PULL_SECRETS}")
    out = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, Mapping) or not ref.get("name") or not ref.get("namespace"):
            raise SetFileError(f"{where}.spec.imagePullSecrets[{i}]: needs namespace and name")
        out.append(SecretRef(str(ref["namespace"]), str(ref["name"])))
    return tuple(out)


@dataclass(frozen=True)
class RoleOverride:
    max_parallel: int | None
    cooldown_seconds: float | None


@dataclass(frozen=True)
class Selected:
    """One set that applies to this node, with what the cluster adds to the file format."""
    set: ImageSet
    uid: str
    secrets: tuple[SecretRef, ...] = ()
    overrides: tuple[RoleOverride, ...] = ()  # those whose nodeSelector matches this node


INVALID_SET = "InvalidSet"  # the reason a set's newest version is refused (status row, Degraded condition)
AWAITING_GRANT = "AwaitingGrant"  # a paced set's generation is declared, the previous version held (grant.py)


@dataclass(frozen=True)
class Refused:
    """A set whose newest version this node refuses. ``kept`` is the generation still in force
    (its last valid version), "" when it never had one."""
    name: str
    kind: str
    generation: str  # of the refused version
    error: str  # names the field (the image) and the rule
    kept: str = ""


def generation_of(obj: Mapping[str, Any]) -> str:
    gen = (obj.get("metadata") or {}).get("generation")
    return str(gen) if gen is not None else ""


def source_of(obj: Mapping[str, Any]) -> str:
    return f"cluster:{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


ParseFn = Callable[[str, Mapping[str, Any], dict[str, Any], str], ImageSet]
"""(key: ``source_of(obj)``, obj, its set document, where) -> the set (parses.py keeps them)."""


def parse_here(key: str, obj: Mapping[str, Any], doc: dict[str, Any], where: str) -> ImageSet:
    return parse_document(doc, where, key)


def own_document(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """An ImageSet object's set document (the file format's fields) and its name in errors."""
    spec = obj.get("spec") or {}
    where = f"ImageSet {(obj.get('metadata') or {}).get('name')}"
    doc = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
           "metadata": {k: v for k, v in (obj.get("metadata") or {}).items() if k in ("name", "generation")},
           "spec": {k: v for k, v in spec.items() if k not in CLUSTER_ONLY_SPEC}}
    return doc, where


def own_set(obj: Mapping[str, Any], labels: Mapping[str, str], parse: ParseFn = parse_here) -> Selected | None:
    """An ImageSet object: None when its nodeSelector does not select this node."""
    spec = obj.get("spec") or {}
    doc, where = own_document(obj)
    try:
        if not selects(spec.get("nodeSelector"), labels, none_selects_all=True):
            return None
    except SelectorError as e:
        raise SetFileError(f"{where}.spec.nodeSelector: {e}") from None
    s = parse(source_of(obj), obj, doc, where)
    secrets = pull_secret_refs(spec, where)
    overrides = []
    for i, o in enumerate(spec.get("roleOverrides") or []):
        try:
            if not selects(o.get("nodeSelector"), labels, none_selects_all=False):
                continue
        except SelectorError as e:
            raise SetFileError(f"{where}.spec.roleOverrides[{i}].nodeSelector: {e}") from None
        mp, cd = o.get("maxParallel"), o.get("cooldownSeconds")
        overrides.append(RoleOverride(int(mp) if mp is not None else None, float(cd) if cd is not None else None))
    return Selected(s, str((obj.get("metadata") or {}).get("uid", "")), tuple(secrets), tuple(overrides))


@dataclass
class PoolSets:
    names: set[str]  # PinnedImageSets the pools selecting this node list
    errors: list[str]  # pools whose nodeSelector cannot be read
    undecided: set[str]  # PinnedImageSets listed by those pools: whether they apply is not known


def pool_listed(spec: Mapping[str, Any]) -> set[str]:
    """The PinnedImageSets a MachineConfigPool's spec lists (``spec.pinnedImageSets[].name``)."""
    return {str(ref["name"]) for ref in spec.get("pinnedImageSets") or []
            if isinstance(ref, Mapping) and ref.get("name")}


def pool_sets(pools: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> PoolSets:
    """The PinnedImageSets the pools of this node list, and what unreadable pools leave undecided."""
    out = PoolSets(set(), [], set())
    for pool in pools:
        spec = pool.get("spec") or {}
        pname = (pool.get("metadata") or {}).get("name")
        try:
            # MCO: a pool without a nodeSelector selects no node
            if not selects(spec.get("nodeSelector"), labels, none_selects_all=False):
                continue
        except SelectorError as e:
            out.errors.append(f"MachineConfigPool {pname}.spec.nodeSelector: {e}")
            out.undecided |= pool_listed(spec)
            continue
        out.names |= pool_listed(spec)
    return out


def pinned_document(obj: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A PinnedImageSet object's set document and its name in errors."""
    meta = obj.get("metadata") or {}
    doc: dict[str, Any] = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
           "metadata": {k: v for k, v in meta.items() if k in ("name", "generation", "annotations")},
           "spec": {k: v for k, v in (obj.get("spec") or {}).items() if k == "pinnedImages"}}
    if HANDLER_ANNOTATION not in (meta.get("annotations") or {}):
        doc["metadata"].pop("annotations", None)
    return doc, f"PinnedImageSet {meta.get('name')}"


def pinned_set(obj: Mapping[str, Any], parse: ParseFn = parse_here) -> Selected:
    doc, where = pinned_document(obj)
    return Selected(parse(source_of(obj), obj, doc, where), str((obj.get("metadata") or {}).get("uid", "")))


def select(node_labels: Mapping[str, str], own: Sequence[Mapping[str, Any]],
           parse: ParseFn = parse_here) -> tuple[dict[str, Selected], dict[str, str]]:
    """The ImageSets that apply to this node, by set name, and errors by object.

    PinnedImageSets (through their pools, ``pool_sets`` and ``pinned_set``) are selected by
    ClusterSource._select, which also keeps the last valid version of a refused set."""
    out: dict[str, Selected] = {}
    errors: dict[str, str] = {}
    for obj in own:
        try:
            sel = own_set(obj, node_labels, parse)
        except SetFileError as e:
            errors[source_of(obj)] = str(e)
            continue
        if sel is not None:
            out[sel.set.name] = sel
    return out, errors
