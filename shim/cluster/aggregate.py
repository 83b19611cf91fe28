"""Which sets get a row in ``NodeImageSetStatus``, and the aggregate of the rest, so the object
stays bounded whatever the number of sets on the node.

Rows go to at most ``cluster.status_max_rows`` sets, chosen in a stable order: problem sets first
(``InvalidSet``, then failing images, then ``PullSecretUnavailable``), then sets still
progressing, then current ones; by name within each. A set's row therefore moves only when its
state does, and a node at rest writes the same rows.

The rest is aggregated:

* ``setStates``: sets by state over every set (``current``, ``progressing``, ``failing``,
  ``invalid``, ``pullSecretUnavailable``); they add up to ``summary.sets``;
* ``worst``: up to ``WORST`` problem sets without a row, worst first, each a row without its
  image counts and with its error cut to ``WORST_ERROR`` characters;
* ``omitted``: ``sets`` (sets without a row), ``current`` (of those, how many are current),
  ``imageSets`` and ``pinnedImageSets``: digests of (name, desiredGeneration) over every cluster
  ``ImageSet``, and every MCO ``PinnedImageSet``, on the node, rows or not. ``cri-shim
  controller`` counts a set without a row or ``worst`` entry as current on this node only when
  every omitted set is current and the digest of its kind equals the one it computes from the
  sets it sees selecting the node (ImageSets by their selector, PinnedImageSets through the pools
  listing them), so a node that has not yet seen a generation is never called current at it.
  Absent when every set has a row.

Worst case: rows of 253-character names with 1,024-character errors are about 1.7 KiB each, so
the object stays under 200 KiB at the default cap (100) and under 240 KiB at the largest (120,
``config.MAX_STATUS_ROWS``); ordinary rows are about 0.3 KiB.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

from .objects import AWAITING_GRANT, INVALID_SET

WORST = 20  # problem sets without a row listed in ``worst``
WORST_ERROR = 256  # characters of each ``worst`` entry's error
STATES = ("invalid", "failing", "pullSecretUnavailable", "progressing", "current")  # worst first
_RANK = {s: i for i, s in enumerate(STATES)}
_NOT_IN_WORST = ("images", "bytesDone", "bytesTotal", "source")


def state_of(row: Mapping[str, Any]) -> str:
    """One state per row (the worst that holds)."""
    reason = row.get("reason")
    if reason == INVALID_SET:
        return "invalid"
    if row.get("failedReasons") or (row.get("images") or {}).get("failed") or (
            row.get("error") and not reason):
        return "failing"
    if reason == AWAITING_GRANT:  # a paced generation not granted yet: not a problem, not current
        return "progressing"
    if reason:
        return "pullSecretUnavailable"
    if row.get("currentGeneration") == row.get("desiredGeneration"):
        return "current"
    return "progressing"


def digest(pairs: Iterable[tuple[str, str]]) -> str:
    """The same on the node and in the controller: sorted ``name generation`` lines, sha256."""
    h = hashlib.sha256()
    for name, generation in sorted(pairs):
        h.update(f"{name}\0{generation}\n".encode())
    return "sha256:" + h.hexdigest()[:32]


def cluster_set_pairs(rows: Iterable[Mapping[str, Any]], kind: str) -> list[tuple[str, str]]:
    """(name, desiredGeneration) of the rows of cluster sets of ``kind`` (ImageSet, PinnedImageSet)."""
    return [(str(r["name"]), str(r.get("desiredGeneration", ""))) for r in rows
            if r.get("source") == "cluster" and r.get("kind") == kind]


def bound(rows: list[dict[str, Any]], max_rows: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the rows kept, by name; the status fields that aggregate every set)."""
    states = {id(r): state_of(r) for r in rows}
    ordered = sorted(rows, key=lambda r: (_RANK[states[id(r)]], r["name"]))
    kept, rest = ordered[:max_rows], ordered[max_rows:]
    counts = dict.fromkeys(STATES, 0)
    for s in states.values():
        counts[s] += 1
    out: dict[str, Any] = {"setStates": {s: counts[s] for s in reversed(STATES)}}
    if rest:
        worst = [r for r in rest if states[id(r)] not in ("progressing", "current")][:WORST]
        if worst:
            out["worst"] = [{**{k: v for k, v in r.items() if k not in _NOT_IN_WORST},
                             **({"error": str(r["error"])[:WORST_ERROR]} if "error" in r else {})} for r in worst]
        out["omitted"] = {"sets": len(rest), "current": sum(1 for r in rest if states[id(r)] == "current"),
                          "imageSets": digest(cluster_set_pairs(rows, "ImageSet")),
                          "pinnedImageSets": digest(cluster_set_pairs(rows, "PinnedImageSet"))}
    kept.sort(key=lambda r: r["name"])
    return kept, out
