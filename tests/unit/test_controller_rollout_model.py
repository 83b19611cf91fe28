"""A paced rollout's decisions (shim/controller/grants.py) under random operator and node sequences:
a model of nodes that pull only with a grant, fail while their image is broken and retry, lose
and regain their shim; an operator who resumes, labels canary nodes, breaks and fixes images. The
rollout goes through its status between steps (report.rollout_of, Previous.read), as the
controller writes and reads it. After every decision:

* grants are given only below ``maxConcurrentNodes`` in flight, never while halted;
* ``failureThreshold`` failing nodes (beyond those tolerated) halt;
* while a canary is not current, only canary nodes are granted; a canary ``nodeSelector`` that
  matches no reporting node (none current yet) halts, with its reason;
* never wedged: not halted and not complete means a node in flight, a new grant, or a reason why
  none can be granted."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shim.controller import grants, report, rollout
from shim.controller.grants import Previous
from shim.controller.truth import NodeReading, Report

T0 = 1_800_000_000.0
GEN = 2
NODES = [f"n{i}" for i in range(6)]


class Rollouts(RuleBasedStateMachine):
    @initialize(limit=st.integers(1, 3), threshold=st.integers(1, 4),
                canary=st.sampled_from(["none", "count", "selector"]),
                broken=st.sets(st.sampled_from(NODES)), canary_nodes=st.sets(st.sampled_from(NODES), max_size=2))
    def setup(self, limit: int, threshold: int, canary: str, broken: set[str], canary_nodes: set[str]) -> None:
        r: dict[str, Any] = {"maxConcurrentNodes": limit, "failureThreshold": threshold}
        if canary == "count":
            r["canary"] = {"count": 1}
        elif canary == "selector":
            r["canary"] = {"nodeSelector": {"matchLabels": {"canary": "yes"}}}
        parsed = rollout.parse({"rollout": r})
        assert parsed is not None
        self.rollout = parsed
        self.state = {n: "waiting" for n in NODES}  # waiting, pulling, current, failing
        self.shim = {n: True for n in NODES}  # False: no NodeImageSetStatus (missing)
        self.broken = set(broken)
        self.labels = {n: ({"canary": "yes"} if n in canary_nodes else {}) for n in NODES}
        self.status: dict[str, Any] = {}
        self.token = 0
        self.decision: grants.Decision | None = None

    def reports(self) -> dict[str, NodeReading]:
        out = {}
        for n in NODES:
            s = self.state[n]
            if not self.shim[n]:
                out[n] = NodeReading(Report.MISSING)
            elif s == "failing":
                out[n] = NodeReading(Report.FAILING, None, ("notFound",), "NOT_FOUND")
            else:
                out[n] = NodeReading({"waiting": Report.WAITING, "pulling": Report.PULLING,
                                      "current": Report.CURRENT}[s], T0 + 3600 if s == "waiting" else None)
        return out

    @rule()
    def controller_batch(self) -> None:
        reports = self.reports()
        previous = Previous.read(self.status, GEN)
        granted_before = set(previous.granted)
        d = grants.decide(self.rollout, self.labels, reports, previous,
                          resume=str(self.token) if self.token else "", now=T0, stale_after=120)
        self.decision = d
        failing = sum(1 for r in reports.values() if r.report is Report.FAILING)
        pulling = sum(1 for r in reports.values() if r.report is Report.PULLING)
        in_flight_before = pulling + len([n for n in granted_before if reports[n].report is Report.WAITING])
        limit = self.rollout.limit(len(reports))
        if d.new_grants:
            assert not d.halted
            assert in_flight_before < limit and d.in_flight <= limit, (in_flight_before, d)
        if failing >= d.tolerated + self.rollout.failure_threshold:
            assert d.halted, d
        assert set(d.new_grants) <= {n for n, r in reports.items() if r.report is Report.WAITING}
        sel = self.rollout.canary_selector
        canary = ([n for n in NODES if self.labels[n] and self.shim[n]] if sel is not None
                  else list(d.canary_nodes))
        if (sel is not None or self.rollout.canary_count) and any(reports[n].report is not Report.CURRENT
                                                                   for n in canary):
            assert set(d.new_grants) <= set(canary), (canary, d)
        if sel is not None and not canary and not any(r.report is Report.CURRENT for r in reports.values()):
            assert d.halted and d.halt_reason == grants.CANARY_MATCHES_NONE and d.why, d
        if not d.halted and d.phase != grants.COMPLETE:
            assert d.in_flight > 0 or d.new_grants or d.why, d
        if d.halted:
            assert not d.new_grants
        # what the controller writes, read back at the next batch
        self.status = {"rollout": report.rollout_of(GEN, d)}
        st_ = report.status_of({"metadata": {"generation": GEN}}, _truth(reports), started=T0, now=T0, decision=d)
        halted = next(c for c in st_["conditions"] if c["type"] == "Halted")
        assert (halted["status"] == "True") == d.halted and halted["message"]

    @rule(node=st.sampled_from(NODES))
    def node_acts(self, node: str) -> None:
        """A shim's next step: a granted node starts; a pull ends current, or failing while broken;
        a failing node retries."""
        s = self.state[node]
        if not self.shim[node]:
            return
        if s == "waiting" and node in ((self.status.get("rollout") or {}).get("granted") or []):
            self.state[node] = "pulling"
        elif s == "pulling":
            self.state[node] = "failing" if node in self.broken else "current"
        elif s == "failing" and node not in self.broken:
            self.state[node] = "pulling"

    @rule(node=st.sampled_from(NODES), broken=st.booleans())
    def registry(self, node: str, broken: bool) -> None:
        (self.broken.add if broken else self.broken.discard)(node)

    @rule()
    def resume(self) -> None:
        self.token += 1

    @rule(node=st.sampled_from(NODES), canary=st.booleans())
    def relabel(self, node: str, canary: bool) -> None:
        self.labels[node] = {"canary": "yes"} if canary else {}

    @rule(node=st.sampled_from(NODES), present=st.booleans())
    def status_object(self, node: str, present: bool) -> None:
        """A node's NodeImageSetStatus deleted (missing), or written again (its report as before)."""
        self.shim[node] = present

    @precondition(lambda self: self.decision is not None)
    @invariant()
    def listed_grants_are_not_yet_reporting(self) -> None:
        assert self.decision is not None
        assert len(self.decision.granted) == len(set(self.decision.granted))


def _truth(reports: dict[str, NodeReading]) -> Any:
    from shim.controller import truth
    by = {k: sum(1 for r in reports.values() if r.report is k) for k in Report}
    return truth.Truth(str(GEN), len(reports), by[Report.CURRENT], by[Report.PULLING], by[Report.FAILING], 0,
                       by[Report.MISSING], {"notFound": by[Report.FAILING]} if by[Report.FAILING] else {}, [], [], [],
                       None, waiting=by[Report.WAITING])


Rollouts.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_rollout_model = Rollouts.TestCase
