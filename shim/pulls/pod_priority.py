"""The priority of a trusted pull, from the pod it is for (the sandbox config kubelet sends).

Two sources, the first that knows wins:

* the **lookup** (``PodLookup``): the pods bound to this node, read from the API server by the
  cluster source; it knows every pod's ``spec.priority`` (its PriorityClass's value). It starts
  after the pull path, so it is given later, once (``PodPriority.use_lookup``); its
  ``None`` (pod not seen yet, source not synced) falls back to the rules;
* the **rules** (``pulls.priority_rules``): a pod has the highest ``priority`` among the rules
  it matches (namespace, labels, or being a static pod: its ``kubernetes.io/config.source``
  annotation, set by kubelet, is there and not ``api``), else 0 (the priority of a pod without
  PriorityClass). By default static pods (control-plane and node agents) are
  ``system-node-critical``.

A pull without a sandbox config (crictl, image sets) has priority 0.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol

from ..config import PriorityRule
from ..proto.runtime.v1 import api_pb2

CONFIG_SOURCE = "kubernetes.io/config.source"  # kubelet's annotation: file | http | api


class PodLookup(Protocol):
    def priority_of(self, namespace: str, name: str, uid: str) -> int | None:
        """The pod's priority, or None when unknown."""


class PodPriority:
    """Resolves a pull's pod priority from the lookup (once given) and the rules."""

    def __init__(self, rules: Iterable[PriorityRule]) -> None:
        self.rules: tuple[PriorityRule, ...] = tuple(rules)
        self.lookup: PodLookup | None = None

    def configure(self, rules: Iterable[PriorityRule]) -> None:
        """The rules of a reloaded config."""
        self.rules = tuple(rules)

    def use_lookup(self, lookup: PodLookup | None) -> None:
        """From now on the lookup (the pods bound to this node, from the API server) is asked
        first; None: the rules alone (the cluster source stopped)."""
        self.lookup = lookup

    def of(self, sandbox: api_pb2.PodSandboxConfig) -> int:
        """The priority of the pod whose sandbox config ``sandbox`` is (0 without one)."""
        meta = sandbox.metadata
        if not meta.name and not meta.namespace:
            return 0
        ruled = self._best_rule(meta.namespace, sandbox.labels, sandbox.annotations)
        known = self.lookup.priority_of(meta.namespace, meta.name, meta.uid) if self.lookup is not None else None
        # the API server's priority when it knows the pod; a rule only ever raises it (a static pod
        # stays node-critical, as kubelet treats it, whatever its mirror pod's priority says)
        if known is None:
            return 0 if ruled is None else ruled
        return known if ruled is None else max(known, ruled)

    def _best_rule(self, namespace: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> int | None:
        source = annotations.get(CONFIG_SOURCE)
        static = source is not None and source != "api"
        best: int | None = None
        for rule in self.rules:
            if _matches(rule, namespace, labels, static) and (best is None or rule.priority > best):
                best = rule.priority
        return best


def _matches(rule: PriorityRule, namespace: str, labels: Mapping[str, str], static: bool) -> bool:
    if not (rule.namespaces or rule.pod_labels or rule.static_pods):
        return False
    if rule.namespaces and namespace not in rule.namespaces:
        return False
    if rule.static_pods and not static:
        return False
    return all(labels.get(k) == v for k, v in rule.pod_labels)
