"""ImageSet.status as the controller writes it (server-side apply to the status subresource,
field manager ``cri-shim-controller``): the counts of truth.py, the rollout's times and the
conditions.

* ``observedGeneration``, ``rolloutStartTime`` (when the controller first saw that generation),
  ``rolloutCompletionTime`` and ``rolloutSeconds`` (start until every selected node was current;
  kept until the next generation).
* ``Available``: every selected node current. ``Progressing``: nodes still pulling or not yet
  caught up. ``Degraded``: a node failed (reason by type: ``AuthFailed``, ``NotFound``, ...),
  or is stale or missing (``NodesStale``, ``NodesMissing``). Slow progress never sets it.
* A paced set (``spec.rollout``): ``waiting`` (nodes waiting for a grant), ``rollout`` (grants.py's
  decision: ``generation`` and ``uid`` (the object's: a grant is for this object), ``phase``
  Canary / Rolling / Halted / Complete, ``maxConcurrentNodes`` as a count, ``inFlight``,
  ``granted``, ``canaryNodes``, ``halted`` with ``haltReason``,
  ``toleratedFailures``, ``resumedWith``, ``staleGranted``: granted nodes counted stale, which
  hold no slot) and the condition ``Halted`` (True with the failing
  nodes' typed reason; ``CanaryMatchesNoNode``, ``CanaryFailing``: halted by the canary until
  its cause is gone). Not halted: ``NotHalted``, or ``NoNodeToGrant`` when nothing is in flight
  and no node can be granted (the message says why). An invalid ``spec.rollout``: Halted True,
  ``InvalidRollout``.
* ``DiskPressure``: nodes whose prefetch of the set waits below kubelet's image GC threshold
  (their rows' ``diskPressure``: used, next image's size, limit); not a failure, so not Degraded.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..cluster.objects import IMAGE_SET, PINNED_REPORT
from .grants import CANARY_FAILING, CANARY_MATCHES_NONE, Decision
from .truth import MAX_LISTED, Truth, format_time, parse_time

FIELD_MANAGER = "cri-shim-controller"
_REASON = {"auth": "AuthFailed", "notFound": "NotFound", "noSpace": "NoSpace", "stalled": "Stalled",
           "other": "PullFailed"}


def rollout_start(image_set: Mapping[str, Any], now: float) -> float:
    """When the set's current generation was first seen: kept in its status across leaders."""
    meta, status = image_set.get("metadata") or {}, image_set.get("status") or {}
    if status.get("observedGeneration") == meta.get("generation"):
        t = parse_time(status.get("rolloutStartTime"))
        if t is not None:
            return t
    return now


def _halted(d: Decision | None, rollout_error: str) -> tuple[str, str, str] | None:
    if rollout_error:
        return ("True", "InvalidRollout", f"{rollout_error}; no node is granted this generation")
    if d is None:
        return None
    if d.halted and d.halt_reason == CANARY_MATCHES_NONE:
        return ("True", "CanaryMatchesNoNode", f"{d.why}: no node is granted until a node it matches reports "
                "(label one, or edit spec.rollout.canary); the canary is never skipped")
    if d.halted and d.halt_reason == CANARY_FAILING:
        return ("True", "CanaryFailing", f"{d.why}: no other node is granted until each canary node is current "
                "(its shim retries: fix what fails; a resume does not pass a failing canary)")
    if not d.halted:
        tail = f"{d.failing} node(s) failing, {d.tolerated} tolerated"
        return ("False", "NoNodeToGrant", f"{d.why}; {tail}") if d.why else ("False", "NotHalted", tail)
    nodes = ", ".join(d.halt_nodes[:5])
    return ("True", _REASON.get(d.halt_reason, d.halt_reason or "FailureThreshold"),
            f"{d.failing} node(s) failing ({nodes or 'none now'}) reached failureThreshold; no new grant until "
            "the set is edited or resumed (annotation cri-shim.io/resume-rollout set to a new value)")


def _conditions(t: Truth, stale_granted: tuple[str, ...] = ()) -> dict[str, tuple[str, str, str]]:
    of = f"{t.current} of {t.selected} selected nodes current"
    if t.selector_error:
        bad = ("True", "InvalidSelector", t.selector_error)
        return {"Available": ("False", "InvalidSelector", t.selector_error),
                "Progressing": ("False", "InvalidSelector", t.selector_error), "Degraded": bad}
    available = ("True", "AllNodesCurrent", of) if t.all_current else ("False", "NodesNotCurrent", of)
    waits = f"; {t.waiting} waiting for a grant" if t.waiting else ""
    if stale_granted:
        waits += (f"; {len(stale_granted)} granted node(s) stale, not holding a slot: "
                  f"{', '.join(stale_granted[:5])}")
    progressing = (("True", "NodesPulling", f"{t.progressing} node(s) pulling or catching up{waits}; {of}")
                   if t.progressing else ("False", "Idle", of + waits))
    if t.failing:
        top = max(t.failed_reasons.items(), key=lambda kv: (kv[1], kv[0]))[0] if t.failed_reasons else "other"
        names = ", ".join(f"{f['node']} ({f['reasons']})" for f in t.failing_nodes[:5])
        degraded = ("True", _REASON.get(top, top), f"{t.failing} node(s) failing: {names}")
    elif t.stale:
        degraded = ("True", "NodesStale",
                    f"{t.stale} node(s) behind with a silent shim: {', '.join(t.stale_nodes[:5])}")
    elif t.missing:
        degraded = ("True", "NodesMissing",
                    f"{t.missing} selected node(s) without any report: {', '.join(t.missing_nodes[:5])}")
    else:
        degraded = ("False", "NoFailures", "no selected node failing, stale or missing")
    if t.pressure:
        nodes = "; ".join(f"{n} ({why})" for n, why in t.pressure_nodes[:5])
        disk = ("True", "DiskPressure", f"{t.pressure} node(s) hold prefetch below kubelet's image GC threshold: "
                f"{nodes}")
    else:
        disk = ("False", "BelowThreshold", "no selected node holds prefetch below kubelet's image GC threshold")
    return {"Available": available, "Progressing": progressing, "Degraded": degraded, "DiskPressure": disk}


def rollout_of(generation: Any, d: Decision, uid: str = "") -> dict[str, Any]:
    """``status.rollout``; ``uid``: the set object's (a grant is for this object, not its name)."""
    out: dict[str, Any] = {"generation": generation, **({"uid": uid} if uid else {}), "phase": d.phase,
                           "maxConcurrentNodes": d.limit, "inFlight": d.in_flight, "granted": list(d.granted),
                           "halted": d.halted}
    if d.canary_nodes:
        out["canaryNodes"] = list(d.canary_nodes)
    if d.halted and d.halt_reason:
        out["haltReason"] = d.halt_reason
    if d.tolerated:
        out["toleratedFailures"] = d.tolerated
    if d.resumed_with:
        out["resumedWith"] = d.resumed_with
    if d.stale_granted:
        out["staleGranted"] = list(d.stale_granted[:MAX_LISTED])
    return out


def status_of(image_set: Mapping[str, Any], t: Truth, *, started: float, now: float,
              decision: Decision | None = None, rollout_error: str = "") -> dict[str, Any]:
    """The status to apply; times carried over from the present status where nothing changed.
    ``decision``: a paced set's grants (grants.py); ``rollout_error``: its spec.rollout is invalid."""
    meta, old = image_set.get("metadata") or {}, image_set.get("status") or {}
    same_gen = old.get("observedGeneration") == meta.get("generation")
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "selected": t.selected, "current": t.current, "progressing": t.progressing, "failing": t.failing,
        "stale": t.stale, "missing": t.missing,
        "rolloutStartTime": format_time(started),
    }
    if decision is not None or rollout_error:
        status["waiting"] = t.waiting
    if decision is not None:
        status["rollout"] = rollout_of(meta.get("generation"), decision, str(meta.get("uid") or ""))
    if t.failed_reasons:
        status["failedReasons"] = dict(t.failed_reasons)
    if t.failing_nodes:
        status["failingNodes"] = list(t.failing_nodes)
    if t.stale_nodes:
        status["staleNodes"] = list(t.stale_nodes)
    if t.missing_nodes:
        status["missingNodes"] = list(t.missing_nodes)
    done_at = parse_time(old.get("rolloutCompletionTime")) if same_gen else None
    if done_at is None and t.all_current and not t.selector_error:
        done_at = now
    if done_at is not None:
        status["rolloutCompletionTime"] = format_time(done_at)
        status["rolloutSeconds"] = max(0, round(done_at - started))
    old_conds = {c.get("type"): c for c in old.get("conditions") or []}
    conds = []
    want = _conditions(t, decision.stale_granted if decision is not None else ())
    halted = _halted(decision, rollout_error)
    if halted is not None:
        want["Halted"] = halted
    for typ, (st, reason, message) in want.items():
        prev = old_conds.get(typ)
        since = prev.get("lastTransitionTime") if prev is not None and prev.get("status") == st else None
        conds.append({"type": typ, "status": st, "reason": reason, "message": message[:2048],
                      "lastTransitionTime": since or format_time(now),
                      "observedGeneration": meta.get("generation")})
    status["conditions"] = conds
    return status


def apply_body(name: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": IMAGE_SET.api_version, "kind": IMAGE_SET.kind, "metadata": {"name": name},
            "status": status}


def pinned_report_body(pinned: Mapping[str, Any], status: dict[str, Any], pools: list[str]) -> dict[str, Any]:
    """A ``PinnedImageSetReport`` (ours, cluster-scoped) for an MCO ``PinnedImageSet`` (MCO owns
    its status): named after it, owned by it (the garbage collector deletes it with the set), the
    status an ImageSet would have plus the pools that select its nodes. Written whole by server-side
    apply; no status subresource (only the controller writes it)."""
    meta = pinned.get("metadata") or {}
    owner = {"apiVersion": pinned.get("apiVersion"), "kind": pinned.get("kind"), "name": meta.get("name"),
             "uid": meta.get("uid")}
    return {"apiVersion": PINNED_REPORT.api_version, "kind": PINNED_REPORT.kind,
            "metadata": {"name": meta.get("name"), "ownerReferences": [owner]},
            "status": {**status, "machineConfigPools": pools}}


def unchanged(image_set: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """True when applying ``status`` would change nothing we own."""
    return dict(image_set.get("status") or {}) == status
