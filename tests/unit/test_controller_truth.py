"""The controller's count of a set's rollout (shim/controller/truth.py, report.py): every
selected node lands in exactly one of current, progressing, failing, stale, missing."""

from __future__ import annotations

from typing import Any

from shim.controller import report, truth

T0 = 1_800_000_000.0


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def nis(name: str, wrote: float, *rows: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": truth.format_time(T0 - 3600),
                         "managedFields": [{"manager": "cri-shim", "operation": "Apply",
                                            "time": truth.format_time(wrote)},
                                           {"manager": "someone", "time": truth.format_time(T0 + 9999)}]},
            "status": {"sets": list(rows)}}


def row(desired: str, current: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"name": "s", "desiredGeneration": desired, **({"currentGeneration": current} if current else {}), **kw}


SET = {"metadata": {"name": "s", "generation": 2}, "spec": {"nodeSelector": {"matchLabels": {"pool": "gpu"}}}}


def compute(nodes: list[dict[str, Any]], statuses: list[dict[str, Any]], now: float,
            changed_at: float = T0) -> truth.Truth:
    return truth.compute(SET, {n["metadata"]["name"]: n for n in nodes},
                         {s["metadata"]["name"]: s for s in statuses}, now=now, changed_at=changed_at,
                         stale_after=120)


def test_each_selected_node_counted_once() -> None:
    nodes = [node(n, pool="gpu") for n in "abcdef"] + [node("x", pool="cpu")]
    statuses = [nis("a", T0, row("2", "2")),                      # current
                nis("b", T0 + 5, row("2", "1")),                  # pulling generation 2
                nis("c", T0, row("2", "1", failedReasons={"auth": 1, "notFound": 2}, error="401")),
                nis("d", T0 - 600, row("1", "1")),                # stopped at 1, silent: stale once 120 s pass
                nis("e", T0 - 600),                               # no row for the set yet, silent
                nis("x", T0, row("1", "1"))]                      # not selected
    t = compute(nodes, statuses, now=T0 + 10)
    assert (t.selected, t.current, t.progressing, t.failing, t.stale, t.missing) == (6, 1, 3, 1, 0, 1)
    assert t.missing_nodes == ["f"] and t.failed_reasons == {"auth": 1, "notFound": 1}
    assert t.failing_nodes == [{"node": "c", "reasons": "auth,notFound", "error": "401"}]
    assert t.next_due == T0 + 120  # d and e turn stale 120 s after the generation change, not before
    t = compute(nodes, statuses, now=T0 + 121)
    assert (t.progressing, t.stale, t.stale_nodes) == (1, 2, ["d", "e"]) and t.next_due is None


def test_a_shim_writing_after_the_change_is_given_its_own_age() -> None:
    nodes = [node("d", pool="gpu")]
    t = compute(nodes, [nis("d", T0 + 100, row("1", "1"))], now=T0 + 130)
    assert (t.progressing, t.stale, t.next_due) == (1, 0, T0 + 220)


def test_deleted_node_is_not_counted_even_with_its_report() -> None:
    t = compute([node("a", pool="gpu")], [nis("a", T0, row("2", "2")), nis("gone", T0, row("1", "1"))], now=T0)
    assert (t.selected, t.current, t.stale) == (1, 1, 0) and t.all_current


def test_conditions_slow_is_not_degraded_and_times_kept() -> None:
    nodes = [node(n, pool="gpu") for n in "ab"]
    t = compute(nodes, [nis("a", T0, row("2", "2")), nis("b", T0, row("2", "1"))], now=T0 + 5)
    st = report.status_of(SET, t, started=T0, now=T0 + 5)
    conds = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert conds == {"Available": ("False", "NodesNotCurrent"), "Progressing": ("True", "NodesPulling"),
                     "Degraded": ("False", "NoFailures"), "DiskPressure": ("False", "BelowThreshold")}
    assert "rolloutSeconds" not in st and st["observedGeneration"] == 2
    later = {**SET, "status": st}
    t = compute(nodes, [nis("a", T0, row("2", "2")), nis("b", T0 + 40, row("2", "2"))], now=T0 + 42)
    st2 = report.status_of(later, t, started=report.rollout_start(later, T0 + 42), now=T0 + 42)
    assert st2["rolloutSeconds"] == 42 and st2["rolloutStartTime"] == truth.format_time(T0)
    degraded = next(c for c in st2["conditions"] if c["type"] == "Degraded")
    assert degraded["lastTransitionTime"] == truth.format_time(T0 + 5)  # unchanged status keeps its time
    assert report.unchanged({**SET, "status": st2}, st2)
    # failing wins the Degraded reason by type; a bad selector selects nothing and says why
    t = compute(nodes, [nis("a", T0, row("2", "1", failedReasons={"notFound": 1}))], now=T0 + 1)
    st3 = report.status_of(SET, t, started=T0, now=T0 + 1)
    assert next(c for c in st3["conditions"] if c["type"] == "Degraded")["reason"] == "NotFound"
    t = compute(nodes, [nis("a", T0, row("2", "1", reason="InvalidSet", error="image 3: not a reference"))],
                now=T0 + 1)
    assert (t.failing, t.failed_reasons) == (1, {"InvalidSet": 1})
    st4 = report.status_of(SET, t, started=T0, now=T0 + 1)
    assert next(c for c in st4["conditions"] if c["type"] == "Degraded")["reason"] == "InvalidSet"
    bad = {**SET, "spec": {"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "Near"}]}}}
    t = truth.compute(bad, {}, {}, now=T0, changed_at=T0, stale_after=120)
    assert t.selector_error and next(c for c in report.status_of(bad, t, started=T0, now=T0)["conditions"]
                                     if c["type"] == "Degraded")["reason"] == "InvalidSelector"
