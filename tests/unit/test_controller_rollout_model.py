"""A paced rollout's decisions (shim/controller/grants.py) under random operator and node sequences:
a model of nodes that pull only with a grant, fail while their image is broken and retry, lose
and regain their status object; an operator who edits the set mid-rollout (the nodes pulling go
on with the previous generation until granted the new one), resumes, labels canary nodes, breaks
and fixes images. The
rollout goes through its status between steps (report.rollout_of, Previous.read), as the
controller writes and reads it. After every decision:

* grants are given only below ``maxConcurrentNodes`` in flight, never while halted; the nodes
  fetching because of a grant (of this generation or, across an edit, of the previous one) are
  never more than ``maxConcurrentNodes`` (a failing node's retries aside: it holds no slot);
* ``failureThreshold`` failing nodes (beyond those tolerated) halt;
* while a canary is not current, only canary nodes are granted; a canary ``nodeSelector`` that
  matches no reporting node (none current yet) halts, with its reason;
* never wedged: not halted and not complete means a node in flight, a new grant, or a reason why
  none can be granted."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shim.controller import grants, report, rollout
from shim.controller.grants import Previous
from shim.controller.truth import NodeReading, Report

T0 = 1_800_000_000.0
NODES = [f"n{i}" for i in range(4)]


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
        self.state = {n: "waiting" for n in NODES}  # waiting, pulling, current, failing, old (previous generation)
        self.counted: set[str] = set()  # fetching because of a grant (not a failing node's retry)
        self.gen = 2
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
            elif s == "old":  # waits for its grant, still pulling the version in force
                out[n] = NodeReading(Report.WAITING, T0 + 3600, fetching=True)
            else:
                out[n] = NodeReading({"waiting": Report.WAITING, "pulling": Report.PULLING,
                                      "current": Report.CURRENT}[s], T0 + 3600 if s == "waiting" else None)
        return out

    @rule()
    def controller_batch(self) -> None:
        """The controller's next batch (it also follows every change below, as a status or set
        event marks the set)."""
        self._batch()

    def _batch(self) -> None:
        reports = self.reports()
        previous = Previous.read(self.status, self.gen)
        granted_before = set(previous.granted)
        d = grants.decide(self.rollout, self.labels, reports, previous,
                          resume=str(self.token) if self.token else "", now=T0, stale_after=120)
        self.decision = d
        failing = sum(1 for r in reports.values() if r.report is Report.FAILING)
        pulling = sum(1 for r in reports.values() if r.report is Report.PULLING)
        fetching = {n for n, r in reports.items() if r.fetching}
        in_flight_before = pulling + len([n for n in granted_before | fetching if reports[n].report is Report.WAITING])
        limit = self.rollout.limit(len(reports))
        if set(d.new_grants) - fetching:  # a grant that takes a slot
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
            # halted: by the canary (and said why), unless a failure halt holds already
            assert d.halted, d
            assert (d.halt_reason == grants.CANARY_MATCHES_NONE and d.why) or previous.halted \
                or failing >= d.tolerated + self.rollout.failure_threshold, d
        if not d.halted and d.phase != grants.COMPLETE:
            assert d.in_flight > 0 or d.new_grants or d.why, d
        if d.halted:
            assert not d.new_grants
        # what the controller writes, read back at the next batch
        self.status = {"rollout": report.rollout_of(self.gen, d)}
        st_ = report.status_of({"metadata": {"generation": self.gen}}, _truth(reports, self.gen), started=T0, now=T0,
                               decision=d)
        halted = next(c for c in st_["conditions"] if c["type"] == "Halted")
        assert (halted["status"] == "True") == d.halted and halted["message"]

    @rule(node=st.sampled_from(NODES), batch=st.booleans())
    def node_acts(self, node: str, batch: bool) -> None:
        """A shim's next step: a granted node starts; a pull ends current, or failing while broken;
        a failing node retries. ``batch``: the controller's batch follows at once."""
        self._act(node)
        if batch:
            self._batch()

    def _act(self, node: str) -> None:
        s = self.state[node]
        if not self.shim[node]:
            return
        ro = self.status.get("rollout") or {}
        granted = ro.get("generation") == self.gen and node in (ro.get("granted") or [])
        if s == "waiting" and granted:
            self.state[node] = "pulling"
            self.counted.add(node)
        elif s == "old":  # granted: switches to the new generation (its slot with it); else its pull ends
            self.state[node] = "pulling" if granted else "waiting"
            if not granted:
                self.counted.discard(node)
        elif s == "pulling":
            self.state[node] = "failing" if node in self.broken else "current"
            self.counted.discard(node)
        elif s == "failing" and node not in self.broken:
            self.state[node] = "pulling"  # a retry: not counted (a failing node holds no slot)

    @rule()
    def edit(self) -> None:
        """A new generation mid-rollout: the nodes pulling go on with the previous one."""
        self.gen += 1
        for n, s in self.state.items():
            self.state[n] = "old" if s == "pulling" else "waiting"
        self.counted &= {n for n, s in self.state.items() if s == "old"}
        self._batch()  # the set's event: the controller decides for the new generation at once

    @invariant()
    def at_most_max_concurrent_nodes_fetch_by_grant(self) -> None:
        if not hasattr(self, "rollout"):
            return
        fetching = {n for n in self.counted if self.state[n] in ("pulling", "old")}
        assert len(fetching) <= self.rollout.limit(len(NODES)), (fetching, self.state)

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
        """A node's NodeImageSetStatus deleted (missing), or written again (its report as before).
        Not while it fetches: a node whose object is deleted mid-pull holds no slot until its shim
        writes it again (within cluster.status_interval_seconds): a known gap, not modelled."""
        if not present and self.state[node] in ("pulling", "old"):
            return
        self.shim[node] = present

    @precondition(lambda self: self.decision is not None)
    @invariant()
    def listed_grants_are_not_yet_reporting(self) -> None:
        assert self.decision is not None
        assert len(self.decision.granted) == len(set(self.decision.granted))


def _truth(reports: dict[str, NodeReading], gen: int) -> Any:
    from shim.controller import truth
    by = {k: sum(1 for r in reports.values() if r.report is k) for k in Report}
    return truth.Truth(str(gen), len(reports), by[Report.CURRENT], by[Report.PULLING], by[Report.FAILING], 0,
                       by[Report.MISSING], {"notFound": by[Report.FAILING]} if by[Report.FAILING] else {}, [], [], [],
                       None, waiting=by[Report.WAITING])


# bounded for CI (a few seconds); longer runs: CRI_SHIM_ROLLOUT_MODEL_EXAMPLES=5000 (docs/testing.md)
EXAMPLES = int(os.environ.get("CRI_SHIM_ROLLOUT_MODEL_EXAMPLES", "200"))
Rollouts.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
test_rollout_model = Rollouts.TestCase
