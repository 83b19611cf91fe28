"""A paced rollout's grants (shim/controller/grants.py, rollout.py): selected nodes + their reports
+ spec.rollout + the rollout last written -> who may pull now, and whether it is halted."""

from __future__ import annotations

from typing import Any

import pytest

from shim.controller import grants, report, rollout, truth
from shim.controller.grants import Previous
from shim.controller.truth import NodeReading, Report

T0 = 1_800_000_000.0
W, B, P, C, M = (NodeReading(Report.WAITING, T0 + 120), NodeReading(Report.BEHIND, T0 + 120), NodeReading(Report.PULLING),
                 NodeReading(Report.CURRENT), NodeReading(Report.MISSING))


def failing(*reasons: str) -> NodeReading:
    return NodeReading(Report.FAILING, None, reasons or ("notFound",), "NOT_FOUND")


def spec(**r: Any) -> rollout.Rollout:
    parsed = rollout.parse({"rollout": r})
    assert parsed is not None
    return parsed


def decide(r: rollout.Rollout, reports: dict[str, NodeReading], previous: Previous = Previous(),
           labels: dict[str, dict[str, str]] | None = None, resume: str = "", now: float = T0,
           granted_at: dict[str, float] | None = None) -> grants.Decision:
    return grants.decide(r, labels or {n: {} for n in reports}, reports, previous, resume=resume, now=now,
                         granted_at=granted_at, stale_after=120)


def test_at_most_max_concurrent_nodes_in_flight_and_grants_free_as_nodes_turn_current() -> None:
    r = spec(maxConcurrentNodes=2)
    nodes = [f"n{i:02}" for i in range(10)]
    reports = {n: W for n in nodes}
    d = decide(r, reports)
    assert d.new_grants == ("n00", "n01") and d.in_flight == 2 and d.phase == grants.ROLLING
    prev = Previous(granted=d.granted)
    # nothing reported yet: the same two, no more
    assert decide(r, reports, prev).granted == ("n00", "n01") and not decide(r, reports, prev).new_grants
    # n00 reports the generation (pulling): it leaves the list, still in flight; n01 current: its slot frees
    reports.update(n00=P, n01=C)
    d = decide(r, reports, prev)
    assert d.granted == ("n02",) and d.in_flight == 2
    # a simulated run to the end: never more than 2 in flight
    prev, step = Previous(granted=d.granted), 0
    while any(v.report is not Report.CURRENT for v in reports.values()):
        for n, v in reports.items():  # every in-flight node moves one step: granted -> pulling -> current
            if v is P:
                reports[n] = C
            elif n in prev.granted:
                reports[n] = P
        d = decide(r, reports, prev)
        assert d.in_flight <= 2, (step, d)
        assert sum(1 for v in reports.values() if v is P) + len(d.granted) <= 2
        prev, step = Previous(granted=d.granted), step + 1
    assert d.phase == grants.COMPLETE and step <= 11


@pytest.mark.parametrize("value,selected,limit", [(3, 10, 3), ("10%", 1000, 100), ("10%", 5, 1), ("25%", 10, 3),
                                                  ("100%", 7, 7)])
def test_max_concurrent_count_or_percentage_rounded_up(value: Any, selected: int, limit: int) -> None:
    assert spec(maxConcurrentNodes=value).limit(selected) == limit


@pytest.mark.parametrize("bad", [{"maxConcurrentNodes": 0}, {"maxConcurrentNodes": "0%"}, {"maxConcurrentNodes": "x"},
                                 {"maxConcurrentNodes": "101%"}, {}, {"maxConcurrentNodes": 1, "failureThreshold": 0},
                                 {"maxConcurrentNodes": 1, "canary": {"count": 1, "nodeSelector": {}}},
                                 {"maxConcurrentNodes": 1, "canary": {}}])
def test_invalid_rollout_names_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(rollout.RolloutError, match=r"spec\.rollout\."):
        rollout.parse({"rollout": bad})


def test_no_rollout_is_not_paced() -> None:
    assert rollout.parse({"images": []}) is None


def test_canary_count_first_and_alone_until_current_and_kept_for_the_generation() -> None:
    r = spec(maxConcurrentNodes=5, canary={"count": 1})
    reports = {"a": M, "b": W, "c": W, "d": W}  # a has no shim: not a canary
    d = decide(r, reports)
    assert (d.phase, d.new_grants, d.canary_nodes) == (grants.CANARY, ("b",), ("b",))
    reports["b"] = P
    d = decide(r, reports, Previous(granted=d.granted, canary_nodes=d.canary_nodes))
    assert d.new_grants == () and d.phase == grants.CANARY
    # a node named before b appears: the canary stays b
    reports["a0"] = W
    d = decide(r, reports, Previous(canary_nodes=d.canary_nodes))
    assert d.canary_nodes == ("b",) and d.new_grants == ()
    reports["b"] = C
    d = decide(r, reports, Previous(canary_nodes=d.canary_nodes))
    assert d.phase == grants.ROLLING and d.new_grants == ("a0", "c", "d")


def test_canary_by_node_selector() -> None:
    r = spec(maxConcurrentNodes=10, canary={"nodeSelector": {"matchLabels": {"canary": "yes"}}})
    labels = {"a": {}, "b": {"canary": "yes"}, "c": {"canary": "yes"}, "d": {}}
    d = decide(r, {n: W for n in labels}, labels=labels)
    assert d.new_grants == ("b", "c") and d.canary_nodes == ()


def test_canary_failing_halts_with_its_reason_and_nobody_else_is_granted() -> None:
    r = spec(maxConcurrentNodes=5, canary={"count": 1})
    d = decide(r, {"a": failing("notFound"), "b": W, "c": W}, Previous(canary_nodes=("a",)))
    assert d.halted and d.phase == grants.HALTED and d.halt_reason == "notFound" and d.new_grants == ()
    st = report.status_of({"metadata": {"generation": 2}}, _truth(), started=T0, now=T0, decision=d)
    halted = next(c for c in st["conditions"] if c["type"] == "Halted")
    assert (halted["status"], halted["reason"]) == ("True", "NotFound") and "a" in halted["message"]
    assert st["rollout"]["phase"] == "Halted" and st["rollout"]["granted"] == []


def _truth() -> truth.Truth:
    return truth.Truth("2", 3, 0, 0, 1, 0, 0, {"notFound": 1}, [], [], [], None, waiting=2)


def test_halt_is_kept_until_resumed_and_granted_nodes_go_on() -> None:
    r = spec(maxConcurrentNodes=3, failureThreshold=2)
    reports = {"a": failing(), "b": W, "c": W, "d": W, "e": W}
    d = decide(r, reports, Previous(granted=("b",)))
    # one failing: below the threshold, and its failure counted, it holds no slot (its shim retries)
    assert not d.halted and d.new_grants == ("c", "d") and d.in_flight == 3
    reports.update(c=failing("auth"))
    d = decide(r, reports, Previous(granted=("b", "d")))
    assert d.halted and d.granted == ("b", "d") and d.new_grants == ()  # granted before: they go on
    prev = Previous(granted=d.granted, halted=True, halt_reason=d.halt_reason)
    reports.update(a=C, c=C, b=C, d=C)  # the failures clear: still halted until an operator resumes
    d = decide(r, reports, prev)
    assert d.halted and d.new_grants == ()
    d = decide(r, reports, prev, resume="1")
    assert not d.halted and d.resumed_with == "1" and d.new_grants == ("e",)
    # the same token does not resume a later halt; a new one does, tolerating the nodes failing then
    reports.update(d=failing(), e=failing())
    d = decide(r, reports, Previous(halted=False, resumed_with="1"), resume="1")
    assert d.halted
    d = decide(r, reports, Previous(halted=True, resumed_with="1"), resume="2")
    assert not d.halted and d.tolerated == 2


def test_a_silent_behind_node_is_not_granted_and_missing_nodes_never_are() -> None:
    r = spec(maxConcurrentNodes=3)
    d = decide(r, {"a": B, "b": M, "c": W}, now=T0 + 121)  # a: behind and silent past its due time
    assert d.new_grants == ("c",)


def test_previous_is_for_its_generation_only() -> None:
    st = {"rollout": {"generation": 1, "granted": ["a"], "halted": True, "resumedWith": "t"}}
    assert Previous.read(st, 2) == Previous(resumed_with="t")
    assert Previous.read(st, 1).granted == ("a",) and Previous.read(st, 1).halted


def test_truth_counts_waiting_nodes_and_a_granted_node_ages_from_its_grant() -> None:
    image_set = {"metadata": {"name": "s", "generation": 2}, "spec": {"rollout": {"maxConcurrentNodes": 1}}}

    def nis(name: str, wrote: float, **row: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "managedFields": [{"manager": "cri-shim", "time": truth.format_time(wrote)}]},
                "status": {"sets": [{"name": "s", **row}]}}
    nodes = {n: {"metadata": {"name": n}} for n in "abc"}
    statuses = {"a": nis("a", T0 - 900, desiredGeneration="2", currentGeneration="1", reason="AwaitingGrant"),
                "b": nis("b", T0 - 900, desiredGeneration="1", currentGeneration="1"),
                "c": nis("c", T0 - 900, desiredGeneration="2", currentGeneration="1", reason="AwaitingGrant")}
    t = truth.compute(image_set, nodes, statuses, now=T0 + 10, changed_at=T0, stale_after=120, paced=True,
                      granted={"c": T0 + 5})
    # a waits (said so); b has not said anything since the change: waiting, stale only once silent 120 s;
    # c granted 5 s ago: progressing
    assert (t.waiting, t.progressing, t.stale) == (2, 1, 0) and t.next_due == T0 + 120
    t = truth.compute(image_set, nodes, statuses, now=T0 + 126, changed_at=T0, stale_after=120, paced=True,
                      granted={"c": T0 + 5})
    assert (t.waiting, t.progressing, t.stale, t.stale_nodes) == (1, 0, 2, ["b", "c"])


def test_a_stale_granted_node_keeps_its_grant_but_frees_its_slot_and_a_deleted_one_leaves() -> None:
    r = spec(maxConcurrentNodes=1)
    waiting = {n: NodeReading(Report.WAITING, T0 + 120) for n in ("a", "b", "c")}
    d = decide(r, waiting, now=T0 + 1)
    assert d.granted == ("a",)
    prev, at = Previous(granted=d.granted), {"a": T0 + 1}
    # a's shim went silent before it saw its grant (still AwaitingGrant): it holds the slot until it
    # is stale, 120 s after its grant (its old report's age is not counted against it) ...
    d = decide(r, waiting, prev, now=T0 + 120.5, granted_at=at)
    assert (d.granted, d.in_flight, d.stale_granted) == (("a",), 1, ())
    # ... then it stops counting: b is granted; a keeps its grant, so it pulls when its shim is back
    d = decide(r, waiting, prev, now=T0 + 121, granted_at=at)
    assert (d.granted, d.new_grants, d.in_flight, d.stale_granted) == (("a", "b"), ("b",), 1, ("a",))
    assert report.rollout_of(2, d)["staleGranted"] == ["a"]
    # a grant not timed yet (a new leader's first look) counts in flight
    assert decide(r, waiting, prev, now=T0 + 500, granted_at={}).new_grants == ()
    # a behind granted node (no row for the generation) is the same
    behind = {**waiting, "a": NodeReading(Report.BEHIND, T0 - 500)}
    assert decide(r, behind, prev, now=T0 + 121, granted_at=at).stale_granted == ("a",)
    # a returns and pulls: in flight again (its slot counts again), nobody new
    prev = Previous(granted=("a", "b"))
    d = decide(r, {**waiting, "a": P}, prev, now=T0 + 130, granted_at={"a": T0 + 1, "b": T0 + 121})
    assert (d.granted, d.in_flight, d.new_grants, d.stale_granted) == (("b",), 2, (), ())
    # a granted node whose Node is deleted is no longer selected: it leaves the list and frees its slot
    d = decide(r, {n: waiting[n] for n in ("b", "c")}, Previous(granted=("a",)), now=T0 + 2, granted_at=at)
    assert (d.granted, d.new_grants) == (("b",), ("b",))


def test_the_status_counts_a_stale_granted_node_stale_and_says_it_holds_no_slot() -> None:
    image_set = {"metadata": {"name": "s", "generation": 2}, "spec": {"rollout": {"maxConcurrentNodes": 1}}}
    nodes = {n: {"metadata": {"name": n}} for n in "ab"}
    row = {"name": "s", "desiredGeneration": "2", "currentGeneration": "1", "reason": "AwaitingGrant"}
    statuses = {n: {"metadata": {"name": n, "managedFields": [{"manager": "cri-shim", "time": truth.format_time(T0)}]},
                    "status": {"sets": [row]}} for n in "ab"}
    reports = truth.read_reports(image_set, nodes, statuses, changed_at=T0, stale_after=120)
    at = {"a": T0 + 10}
    d = grants.decide(spec(maxConcurrentNodes=1), {n: {} for n in nodes}, reports, Previous(granted=("a",)),
                      now=T0 + 131, granted_at=at, stale_after=120)
    granted = {n: at.get(n, T0 + 131) for n in d.granted}
    t = truth.compute(image_set, nodes, statuses, now=T0 + 131, changed_at=T0, stale_after=120, paced=True,
                      granted=granted, reports=reports)
    assert (t.stale, t.stale_nodes, t.progressing, d.granted) == (1, ["a"], 1, ("a", "b"))
    st = report.status_of(image_set, t, started=T0, now=T0 + 131, decision=d)
    assert st["rollout"]["staleGranted"] == ["a"] and st["rollout"]["inFlight"] == 1
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert "1 granted node(s) stale, not holding a slot: a" in progressing["message"], progressing


def halted_condition(d: grants.Decision) -> dict[str, Any]:
    st = report.status_of({"metadata": {"generation": 2}}, _truth(), started=T0, now=T0, decision=d)
    return next(c for c in st["conditions"] if c["type"] == "Halted")


def test_failure_threshold_above_max_concurrent_nodes_halts() -> None:
    """Issue 45: failureThreshold 3, maxConcurrentNodes 2, the image missing everywhere. A failing
    node frees its slot once counted, so the third failure is reached and halts."""
    r = spec(maxConcurrentNodes=2, failureThreshold=3)
    reports = {f"n{i}": W for i in range(6)}
    prev, rounds = Previous(), 0
    while True:
        d = decide(r, reports, prev)
        if d.halted:
            break
        assert d.in_flight <= 2 and d.new_grants, d  # never wedged: two slots are always in use
        for n in d.granted:  # each granted node pulls and fails
            reports[n] = failing("notFound")
        prev, rounds = Previous(granted=d.granted), rounds + 1
    assert (d.phase, d.halt_reason, d.failing) == (grants.HALTED, "notFound", 4) and rounds == 2
    assert sum(1 for v in reports.values() if v.report is Report.WAITING) == 2  # they keep the previous version
    cond = halted_condition(d)
    assert (cond["status"], cond["reason"]) == ("True", "NotFound") and "reached failureThreshold" in cond["message"]


def test_a_resume_grants_again_even_with_the_failing_node_in_the_only_slot() -> None:
    r = spec(maxConcurrentNodes=1)
    reports = {"a": failing(), "b": W, "c": W}
    d = decide(r, reports, Previous(halted=True, halt_reason="notFound"), resume="t1")
    assert not d.halted and d.new_grants == ("b",) and d.tolerated == 1


def test_a_canary_selector_matching_no_node_halts_with_its_reason_until_one_matches() -> None:
    r = spec(maxConcurrentNodes=5, canary={"nodeSelector": {"matchLabels": {"canary": "yes"}}})
    labels: dict[str, dict[str, str]] = {n: {} for n in "abcd"}
    reports = {n: W for n in labels}
    d = decide(r, reports, labels=labels)
    assert (d.phase, d.halted, d.halt_reason, d.new_grants) == (grants.HALTED, True, grants.CANARY_MATCHES_NONE, ())
    cond = halted_condition(d)
    assert (cond["status"], cond["reason"]) == ("True", "CanaryMatchesNoNode")
    assert "spec.rollout.canary.nodeSelector matches none of the 4 selected node(s)" in cond["message"]
    written = report.rollout_of(2, d)
    assert written["phase"] == "Halted" and written["haltReason"] == "canaryMatchesNoNode"
    # a resume does not skip the canary
    assert decide(r, reports, Previous.read({"rollout": written}, 2), labels=labels, resume="x").new_grants == ()
    # it matches a node without any report: said so
    labels["a"] = {"canary": "yes"}
    d = decide(r, {**reports, "a": M}, labels=labels)
    assert d.halted and d.halt_nodes == ("a",) and "matches 1 of the 4 selected node(s), none with a report" in d.why
    # a reporting node labelled: the halt lifts by itself (not an operator's halt), the canary goes first
    d = decide(r, reports, Previous.read({"rollout": written}, 2), labels=labels)
    assert (d.phase, d.halted, d.new_grants) == (grants.CANARY, False, ("a",))


def test_a_failing_canary_below_the_threshold_halts_and_a_resume_says_why_it_does_not_pass() -> None:
    r = spec(maxConcurrentNodes=3, canary={"count": 1}, failureThreshold=3)
    reports = {"a": failing(), "b": W, "c": W}
    prev = Previous(canary_nodes=("a",))
    d = decide(r, reports, prev)
    assert (d.phase, d.halt_reason, d.new_grants) == (grants.HALTED, grants.CANARY_FAILING, ())
    cond = halted_condition(d)
    assert (cond["status"], cond["reason"]) == ("True", "CanaryFailing") and "a resume does not pass" in cond["message"]
    assert "canary node(s) failing: a" in cond["message"]
    d = decide(r, reports, prev, resume="t1")
    assert d.halted and d.resumed_with == "t1" and d.new_grants == ()
    # the canary's image fixed: current, the rollout goes on without an operator
    reports["a"] = C
    d = decide(r, reports, Previous(canary_nodes=("a",), resumed_with="t1"))
    assert (d.phase, d.new_grants) == (grants.ROLLING, ("b", "c"))


def test_nothing_to_grant_is_said_in_the_halted_condition() -> None:
    r = spec(maxConcurrentNodes=2, failureThreshold=5)
    d = decide(r, {"a": C, "b": failing(), "c": M, "d": B}, now=T0 + 121)  # d: behind, its shim silent
    assert (d.phase, d.halted, d.in_flight, d.new_grants) == (grants.ROLLING, False, 0, ())
    cond = halted_condition(d)
    assert (cond["status"], cond["reason"]) == ("False", "NoNodeToGrant")
    assert ("no node can be granted: the 3 not current are 1 without any report (missing), "
            "1 behind with a silent shim (stale), 1 failing") in cond["message"], cond


def test_an_edit_mid_rollout_never_lets_more_than_max_concurrent_nodes_fetch() -> None:
    """Issue 45: maxConcurrentNodes 2, two nodes pulling generation 1 when generation 2 comes: they
    still fetch (their rows: waiting for generation 2, images pulling), so they hold both slots;
    they are granted generation 2 first, at no slot's cost, and nobody else is."""
    r = spec(maxConcurrentNodes=2)
    old = NodeReading(Report.WAITING, T0 + 120, fetching=True)
    reports = {"a": W, "b": W, "c": old, "d": old, "e": W}
    d = decide(r, reports)  # generation 2's first batch: nothing granted for it yet
    assert (d.new_grants, d.in_flight) == (("c", "d"), 2)
    # c finishes generation 1 first (no longer fetching) before it saw its grant: still its slot
    d = decide(r, {**reports, "c": W}, Previous(granted=("c", "d")))
    assert (d.new_grants, d.in_flight) == ((), 2)
    # the rows of the nodes pulling generation 1 read so from a real status object
    image_set = {"metadata": {"name": "s", "generation": 2}, "spec": {"rollout": {"maxConcurrentNodes": 2}}}
    row = {"name": "s", "desiredGeneration": "2", "currentGeneration": "0", "reason": "AwaitingGrant",
           "images": {"declared": 1, "present": 0, "pulling": 1, "queued": 0, "failed": 0}}
    nis = {"metadata": {"name": "c", "managedFields": [{"manager": "cri-shim", "time": truth.format_time(T0)}]},
           "status": {"sets": [row]}}
    read = truth.read_reports(image_set, {"c": {"metadata": {"name": "c"}}}, {"c": nis}, changed_at=T0,
                              stale_after=120)
    assert read["c"].report is Report.WAITING and read["c"].fetching
    # a limit of 1 and two nodes still fetching: neither new grant takes a slot, nobody else starts
    d = decide(spec(maxConcurrentNodes=1), reports)
    assert d.new_grants == ("c", "d") and d.in_flight == 2


def test_a_set_created_again_is_counted_as_new_not_by_an_old_row_of_its_name() -> None:
    """Issue 45: a set deleted and created again starts at generation 1 again. A node's row for the
    old object (its uid) says nothing about the new one; a waiting row whose version in force is the
    old object's (currentUid) is waiting, not current; the rollout last written for the old object
    is not this one's."""
    image_set = {"metadata": {"name": "s", "generation": 1, "uid": "new"}, "spec": {"rollout": {"maxConcurrentNodes": 1}}}

    def nis(**row: Any) -> dict[str, Any]:
        return {"metadata": {"name": "n", "managedFields": [{"manager": "cri-shim", "time": truth.format_time(T0)}]},
                "status": {"sets": [{"name": "s", "desiredGeneration": "1", "currentGeneration": "1", **row}]}}
    nodes = {"n": {"metadata": {"name": "n"}}}

    def read(**row: Any) -> Report:
        return truth.read_reports(image_set, nodes, {"n": nis(**row)}, changed_at=T0, stale_after=120)["n"].report
    assert read(uid="old") is Report.BEHIND  # the stopped node's row: about the deleted object
    assert read(uid="new", currentUid="old", reason="AwaitingGrant") is Report.WAITING
    assert read(uid="new") is Report.CURRENT
    assert read() is Report.CURRENT  # a shim that writes no uid: read by generation, as before
    old = {"rollout": {"generation": 1, "uid": "old", "granted": ["n"], "halted": True, "resumedWith": "t"}}
    assert Previous.read(old, 1, "new") == Previous()
    assert Previous.read(old, 1, "old").halted and Previous.read(old, 1).granted == ("n",)
    d = decide(spec(maxConcurrentNodes=1), {"n": W})
    assert report.rollout_of(1, d, "new")["uid"] == "new"
