"""``spec.rollout`` of an ImageSet: how fast a new generation may reach the selected nodes.

* ``maxConcurrentNodes``: a count (``2``) or a percentage of the selected nodes (``"10%"``,
  rounded up, at least 1): nodes that may pull the generation at once.
* ``canary`` (optional): ``{count: N}`` (N nodes the controller picks, by name, and keeps for the
  generation) or ``{nodeSelector: <LabelSelector>}``: those nodes are granted first, and no
  other node is until each of them is current.
* ``failureThreshold`` (default 1): this many failing nodes halt the rollout.

Without ``spec.rollout`` a set is not paced (every node pulls at once, as before). The CRD's
CEL rules refuse an invalid rollout at ``kubectl apply``; ``parse`` checks again (a CRD can be
older than the controller) and says which field is wrong.

An operator resumes a halted rollout by setting the annotation ``RESUME_ANNOTATION`` to any new
value (``kubectl annotate imageset web cri-shim.io/resume-rollout="$(date +%s)" --overwrite``):
each value resumes once. An annotation does not change the set's generation, so the rollout
goes on where it stopped instead of starting over.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

RESUME_ANNOTATION = "cri-shim.io/resume-rollout"
_PERCENT = re.compile(r"^([0-9]{1,3})%$")


class RolloutError(ValueError):
    pass


@dataclass(frozen=True)
class Rollout:
    max_concurrent: int | str  # a count, or "N%" of the selected nodes
    failure_threshold: int = 1
    canary_count: int = 0
    canary_selector: Mapping[str, Any] | None = None

    def limit(self, selected: int) -> int:
        """Nodes that may pull at once among ``selected``: at least 1."""
        if isinstance(self.max_concurrent, int):
            return self.max_concurrent
        pct = int(self.max_concurrent[:-1])
        return max(1, math.ceil(selected * pct / 100))


def _count(where: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise RolloutError(f"spec.rollout.{where}: expected an integer >= {minimum}, got {v!r}")
    return v


def parse(spec: Mapping[str, Any]) -> Rollout | None:
    """The set's rollout, None when it has none (not paced)."""
    r = spec.get("rollout")
    if r is None:
        return None
    if not isinstance(r, Mapping):
        raise RolloutError("spec.rollout: expected a map")
    mc = r.get("maxConcurrentNodes")
    if isinstance(mc, str):
        m = _PERCENT.match(mc)
        if m is None or not 1 <= int(m[1]) <= 100:
            raise RolloutError(f"spec.rollout.maxConcurrentNodes: expected a count or a percentage 1%-100%, got {mc!r}")
        max_concurrent: int | str = mc
    else:
        max_concurrent = _count("maxConcurrentNodes", mc, 1)
    threshold = _count("failureThreshold", r.get("failureThreshold", 1), 1)
    canary = r.get("canary")
    count, selector = 0, None
    if canary is not None:
        if not isinstance(canary, Mapping) or ("count" in canary) == ("nodeSelector" in canary):
            raise RolloutError("spec.rollout.canary: expected exactly one of count or nodeSelector")
        if "count" in canary:
            count = _count("canary.count", canary["count"], 1)
        else:
            selector = canary["nodeSelector"]
            if not isinstance(selector, Mapping):
                raise RolloutError("spec.rollout.canary.nodeSelector: expected a label selector")
    return Rollout(max_concurrent, threshold, count, selector)


def resume_token(image_set: Mapping[str, Any]) -> str:
    """The resume annotation's value ("" when absent)."""
    annotations = (image_set.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(RESUME_ANNOTATION) or "")
