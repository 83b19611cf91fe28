"""Which nodes may pull a paced set's generation now: a pure function of the set's rollout
(rollout.py), the selected nodes, their reports (truth.read_report) and the rollout as last
written. No I/O, no clock but ``now``.

A node is *in flight* from its grant until it is current or failing: granted and not yet
reporting the generation (the ``granted`` list), or reporting it and pulling; and so is a node
not granted that still fetches another generation of the set (truth.NodeReading.fetching: after
an edit mid-rollout, the nodes pulling the previous one), so an edit never lets more than
``maxConcurrentNodes`` fetch. Such a node is granted the new generation first, at no slot's cost
(it holds one already; its shim switches to the new one). Grants are given
while fewer than ``maxConcurrentNodes`` are in flight: at most that many nodes pull the
generation at once. A failing node frees its slot once its failure is counted (its shim retries
with backoff; it counts toward ``failureThreshold``, which decides), so failures are decided, not
waited on: a threshold above ``maxConcurrentNodes`` is reached.

* A granted node that is stale (truth.stale_at: still behind ``stale_after`` past its grant, its
  shim silent) is not in flight: it keeps its grant (it pulls when its shim comes back, and then
  counts again), but its slot goes to the next node. A granted node whose Node is deleted is no
  longer selected: it leaves the list. The grant times are the controller's (when it first saw
  each grant); a grant it has not timed yet counts in flight.
* Who: nodes waiting (their report says so, or they are behind and their shim is not silent),
  by name; canary nodes first, and only they until each of them is current.
* Canary ``count``: that many nodes with a report, picked by name once per generation and kept
  (``canaryNodes``), so a node added later does not move the canary. Canary ``nodeSelector``:
  the selected nodes it matches (a node without any report is left out: it cannot turn current).
* Halt: ``failureThreshold`` failing nodes (beyond those tolerated at the last resume). A halt
  gives no new grant until the set is edited (a new generation: a new rollout) or resumed (the
  resume annotation set to a new value: the nodes failing then are tolerated). Nodes granted
  before the halt go on; nodes not granted keep the previous generation.
* Halted by the canary (``BLOCKS``; recomputed each time, lifted once the cause is gone, a resume
  does not pass it): a canary ``nodeSelector`` that matches no selected node with a report while
  no node is current (``canaryMatchesNoNode``: never dropped silently, the whole fleet would
  start at once), or a canary node failing below the threshold (``canaryFailing``: no other node
  starts until each canary node is current).
* Nothing to grant (``stuck``): not halted, not complete, nothing in flight and no node that can
  be granted (every other node missing, silent or failing): said, not left as ``Rolling``.
* The list holds a node only until it reports the generation: at most ``maxConcurrentNodes``
  names (plus any canary and the stale granted nodes), never the whole fleet. That is what each
  node's ImageSet watch carries (docs/image-sets.md "Paced rollout").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..cluster.objects import selects
from .rollout import Rollout
from .truth import NodeReading, Report, stale_at

CANARY, ROLLING, HALTED, COMPLETE = "Canary", "Rolling", "Halted", "Complete"
CANARY_MATCHES_NONE, CANARY_FAILING = "canaryMatchesNoNode", "canaryFailing"
BLOCKS = (CANARY_MATCHES_NONE, CANARY_FAILING)  # halts that lift once their cause is gone (no resume)
_UNSTARTED = (Report.WAITING, Report.BEHIND)


@dataclass(frozen=True)
class Previous:
    """``status.rollout`` as last written, when it is for the same generation."""
    granted: tuple[str, ...] = ()
    canary_nodes: tuple[str, ...] = ()
    halted: bool = False
    halt_reason: str = ""
    tolerated: int = 0
    resumed_with: str = ""

    @classmethod
    def read(cls, status: Mapping[str, Any], generation: Any, uid: str = "") -> Previous:
        """From an ImageSet's status; empty when it is for another generation (the resume
        token acted on is kept across generations: an old token never resumes a new halt), or
        for another object of that name (``uid``: a set deleted and created again is new)."""
        r = status.get("rollout") or {}
        if uid and r.get("uid") and r.get("uid") != uid:
            return cls()
        token = str(r.get("resumedWith") or "")
        if r.get("generation") != generation:
            return cls(resumed_with=token)
        reason = str(r.get("haltReason") or "")
        return cls(tuple(r.get("granted") or ()), tuple(r.get("canaryNodes") or ()),
                   bool(r.get("halted")) and reason not in BLOCKS,  # a canary's halt is decided anew
                   reason, int(r.get("toleratedFailures") or 0), token)


@dataclass(frozen=True)
class Decision:
    phase: str
    limit: int  # maxConcurrentNodes as a count of the selected nodes
    in_flight: int  # after the new grants
    granted: tuple[str, ...]  # granted, not yet reporting the generation (new ones included)
    new_grants: tuple[str, ...]
    canary_nodes: tuple[str, ...]  # canary count: the nodes picked; nodeSelector: ()
    halted: bool
    halt_reason: str  # the failing nodes' most common typed reason when halted; or one of BLOCKS
    halt_nodes: tuple[str, ...] = ()  # failing nodes when halted, by name (up to 20); BLOCKS: the canary's
    tolerated: int = 0
    resumed_with: str = ""
    failing: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # reports by kind
    stale_granted: tuple[str, ...] = ()  # granted, stale: not in flight (they keep their grant)
    why: str = ""  # BLOCKS: what the canary matches; not halted: why no node can be granted ("" when one can)


def _canary(rollout: Rollout, nodes: Mapping[str, Mapping[str, str]], reports: Mapping[str, NodeReading],
            previous: Previous) -> tuple[list[str], tuple[str, ...]]:
    """(the canary nodes now, the picked ones to keep in the status)."""
    if rollout.canary_selector is not None:
        return ([n for n in sorted(nodes) if reports[n].report is not Report.MISSING
                 and selects(rollout.canary_selector, nodes[n], none_selects_all=False)], ())
    if not rollout.canary_count:
        return [], ()
    kept = [n for n in previous.canary_nodes if n in reports and reports[n].report is not Report.MISSING]
    for n in sorted(reports):
        if len(kept) >= rollout.canary_count:
            break
        if n not in kept and reports[n].report is not Report.MISSING:
            kept.append(n)
    kept = sorted(kept[:rollout.canary_count])
    return kept, tuple(kept)


def _unable(pool: list[str], reports: Mapping[str, NodeReading], canary: bool) -> str:
    """Why none of ``pool`` (the nodes that could be granted next) can be, by kind."""
    by = Counter(reports[n].report for n in pool if reports[n].report is not Report.CURRENT)
    silent = by[Report.BEHIND] + by[Report.WAITING]  # not granted, or granted and stale: their shim is silent
    parts = [f"{by[Report.MISSING]} without any report (missing)" if by[Report.MISSING] else "",
             f"{silent} behind with a silent shim (stale)" if silent else "",
             f"{by[Report.FAILING]} failing" if by[Report.FAILING] else ""]
    return (f"no {'canary ' if canary else ''}node can be granted: the {sum(by.values())} not current are "
            + ", ".join(p for p in parts if p))


def decide(rollout: Rollout, nodes: Mapping[str, Mapping[str, str]], reports: Mapping[str, NodeReading],
           previous: Previous, *, resume: str = "", now: float, granted_at: Mapping[str, float] | None = None,
           stale_after: float = 0.0) -> Decision:
    """``nodes``: the selected nodes' labels by name; ``reports``: theirs, by name (the same keys);
    ``granted_at``: when each granted node was granted (wall clock), for its staleness."""
    counts = Counter(r.report.value for r in reports.values())
    failing = sorted(n for n, r in reports.items() if r.report is Report.FAILING)
    halted, tolerated, resumed_with = previous.halted, previous.tolerated, previous.resumed_with
    if resume and resume != resumed_with:
        resumed_with = resume
        if halted:  # the nodes failing now are tolerated; more than the threshold beyond them halt again
            halted, tolerated = False, len(failing)
    if not halted and len(failing) >= tolerated + rollout.failure_threshold:
        halted = True
    reason = previous.halt_reason if previous.halted and halted else ""
    if halted and failing:
        top = Counter(x for n in failing for x in reports[n].reasons).most_common()
        reason = min(top, key=lambda kv: (-kv[1], kv[0]))[0] if top else "other"
    halt_nodes = tuple(failing[:20]) if halted else ()

    granted = [n for n in previous.granted if n in reports and reports[n].report in _UNSTARTED]
    timed = granted_at or {}
    stale = tuple(n for n in granted if n in timed
                  and now >= (stale_at(reports[n], timed[n], stale_after) or float("inf")))
    # failing nodes hold no slot: their failure is counted (failureThreshold decides), not waited on;
    # a node fetching another generation of the set (an edit mid-rollout) holds one
    taken = set(granted)
    fetching = {n for n, r in reports.items() if r.report in _UNSTARTED and r.fetching and n not in taken}
    in_flight = len(granted) - len(stale) + counts[Report.PULLING.value] + len(fetching)
    limit = rollout.limit(len(reports))
    canary, picked = _canary(rollout, nodes, reports, previous)
    canary_pending = [n for n in canary if reports[n].report is not Report.CURRENT]
    complete = counts[Report.CURRENT.value] == len(reports)
    why = ""
    if not halted and not complete:
        if rollout.canary_selector is not None and not canary and not counts[Report.CURRENT.value]:
            matched = [n for n in sorted(nodes) if selects(rollout.canary_selector, nodes[n], none_selects_all=False)]
            halted, reason, halt_nodes = True, CANARY_MATCHES_NONE, tuple(matched[:20])
            why = (f"spec.rollout.canary.nodeSelector matches {len(matched)} of the {len(reports)} selected "
                   "node(s), none with a report (no shim has written its NodeImageSetStatus)" if matched else
                   f"spec.rollout.canary.nodeSelector matches none of the {len(reports)} selected node(s)")
        elif bad := [n for n in canary_pending if reports[n].report is Report.FAILING]:
            halted, reason, halt_nodes = True, CANARY_FAILING, tuple(bad[:20])
            why = f"canary node(s) failing: {', '.join(bad[:5])}"
    new: list[str] = []
    pool = canary_pending if canary_pending else sorted(reports)
    if not halted:
        new = [n for n in pool if n in fetching]  # in flight already: the grant costs no slot
        free = limit - in_flight
        for n in pool:
            if free <= 0:
                break
            r = reports[n]
            if n in taken or n in fetching or r.report not in _UNSTARTED:
                continue
            if r.report is Report.BEHIND and r.due is not None and now >= r.due:
                continue  # its shim is silent: a grant would hold a slot nobody uses
            new.append(n)
            free -= 1
    if not halted and not complete and not new and in_flight == 0:
        why = _unable(pool, reports, bool(canary_pending))
    if halted:
        phase = HALTED
    elif complete:
        phase = COMPLETE
    elif canary_pending:
        phase = CANARY
    else:
        phase = ROLLING
    in_flight += len(set(new) - fetching)
    return Decision(phase, limit, in_flight, tuple(granted + new), tuple(new), picked, halted, reason,
                    halt_nodes, tolerated, resumed_with, len(failing), dict(counts), stale, why)
