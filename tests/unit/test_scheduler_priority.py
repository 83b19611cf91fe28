"""Trusted pulls by their pod's priority, then age (shim/pulls/queue.py, the ordering rule).

A stateful property over random arrivals (trusted callers with random pod priorities,
untrusted callers of two uids, prefetch; several images, so callers join each other's
flights), callers leaving, pulls finishing, and the clock moving on. At every start:

* a trusted flight starts only if no queued trusted flight has a higher effective priority
  (age band, then pod priority, then age); so of two trusted flights queued at the same time
  the one of the higher pod priority starts first;
* the aging bound: a trusted flight never starts while one that entered the trusted class
  ``pulls.priority_aging_seconds`` or more before it is still queued;
* a collapsed flight's pod priority is the highest of its trusted callers waiting now;
* the class rules are unchanged: nothing but a trusted flight starts while one is queued
  (no critical slots here), an untrusted flight is the oldest of its uid, prefetch the
  oldest prefetch.

Named cases below for the user-visible behaviour (critical pod first, aging, joins, critical
slots, ``pulls.priority_order: false``) and the pod priority resolver.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shim.config import SYSTEM_CLUSTER_CRITICAL, SYSTEM_NODE_CRITICAL, ConfigError, PriorityRule, from_dict
from shim.errors import RpcError
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.key import PullKey
from shim.pulls.pod_priority import PodPriority
from shim.pulls.scheduler import Flight, PullEvents, PullScheduler
from shim.pulls.slots import Priority

FG, U, BG = Priority.FOREGROUND, Priority.UNTRUSTED, Priority.BACKGROUND
AGING = 10.0
PRIORITIES = [0, 1000, SYSTEM_CLUSTER_CRITICAL, SYSTEM_NODE_CRITICAL]
WHO = [(FG, None)] * 6 + [(U, 1000), (U, 1001), (BG, None)]


def key(image: str) -> PullKey:
    return PullKey(image=image, requested=image)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def effective(f: Flight, now: float) -> tuple[int, int, int]:
    """What the ordering rule compares, best first when smallest."""
    return (-math.floor((now - f.since) / AGING), -f.rank, f.order)


class Starts(PullEvents):
    """Checks each start against the flights still queued at that moment."""

    def __init__(self, machine: "PriorityOrder") -> None:
        self.m = machine

    def flight_started(self, flight: Flight, waited: float) -> None:
        try:  # raised here it would reach a caller's task, not the test: kept for the invariant
            self.check(flight)
        except AssertionError as e:
            self.m.broken.append(str(e))

    def check(self, flight: Flight) -> None:
        queued = [f for group in self.m.s.flights().values() for f in group if f.queued and f is not flight]
        now = self.m.clock.now
        if flight.priority is FG:
            for g in (g for g in queued if g.priority is FG):
                assert effective(flight, now) < effective(g, now), \
                    f"trusted flight {flight.seq} (pod priority {flight.rank}) started before {g.seq} ({g.rank})"
                assert flight.since < g.since + AGING, \
                    f"flight {flight.seq} entered {flight.since - g.since:g} s after {g.seq} and overtook it"
        else:
            assert not any(g.priority is FG for g in queued), f"{flight.priority.name} started before a trusted flight"
            same = [g for g in queued if g.priority is flight.priority and g.uid == flight.uid]
            assert all(flight.order < g.order for g in same), f"{flight.priority.name} flight out of order"
        self.m.started.append(flight)


class PriorityOrder(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.s = PullScheduler(max_parallel=2, aging_seconds=AGING, clock=self.clock)
        self.s.subscribe(Starts(self))
        self.ids = itertools.count()
        self.gates: dict[int, asyncio.Future[bytes]] = {}
        self.callers: dict[int, tuple[asyncio.Task[object], Priority, int]] = {}  # id -> (task, class, pod priority)
        self.listeners: dict[int, Callable[[str, object], None]] = {}
        self.started: list[Flight] = []
        self.broken: list[str] = []  # ordering rules a start broke

    @initialize(cap=st.integers(min_value=1, max_value=2))
    def configure(self, cap: int) -> None:
        self.settle(lambda: self.s.configure(cap, max(1, cap - 1), True, aging_seconds=AGING))

    def settle(self, first: Callable[[], object] = lambda: None) -> None:
        async def steps() -> None:
            first()
            for _ in range(20):
                await asyncio.sleep(0)
        self.loop.run_until_complete(steps())

    def teardown(self) -> None:
        for task, _, _ in self.callers.values():
            task.cancel()
        self.settle()
        self.loop.close()

    @rule(batch=st.lists(st.tuples(st.sampled_from(WHO), st.sampled_from("abcdefgh"), st.sampled_from(PRIORITIES)),
                         min_size=1, max_size=6))
    def arrive(self, batch: list[tuple[tuple[Priority, int | None], str, int]]) -> None:
        """Callers arriving at the same moment (a join when the image is already asked for)."""
        for who, image, prio in batch:
            self.one_arrives(who, image, prio)
        self.settle()

    def one_arrives(self, who: tuple[Priority, int | None], image: str, prio: int) -> None:
        cls, uid = who
        if cls is U and self.s.slots.untrusted_slots == 0:
            return
        cid = next(self.ids)

        async def run() -> bytes:
            gate = self.gates[cid] = self.loop.create_future()
            try:
                return await gate
            finally:
                self.gates.pop(cid, None)

        def listener(name: str, attrs: object) -> None:
            """How the test finds the caller's flight."""

        async def call() -> object:
            try:
                return await self.s.pull(key(image), run, priority=cls, uid=uid, pod_priority=prio, listener=listener)
            except RpcError as e:
                return e

        self.listeners[cid] = listener
        self.callers[cid] = (self.loop.create_task(call()), cls, prio)

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        waiting = sorted(c for c, (t, _, _) in self.callers.items() if not t.done())
        if waiting:
            self.settle(self.callers[data.draw(st.sampled_from(waiting))][0].cancel)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.gates:
            gate = self.gates[data.draw(st.sampled_from(sorted(self.gates)))]
            self.settle(lambda: gate.set_result(b"ok"))

    @rule(seconds=st.sampled_from([0.5, 3.0, AGING, 25.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def every_start_kept_the_ordering_rules(self) -> None:
        assert not self.broken, self.broken[0]

    @invariant()
    def a_flight_has_its_highest_trusted_callers_pod_priority(self) -> None:
        for group in self.s.flights().values():
            for f in group:
                if f.queued and f.priority is FG:
                    mine = [p for c, (t, cls, p) in self.callers.items()
                            if not t.done() and cls is FG and self.listeners[c] in f.listeners]
                    assert mine and f.rank == max(mine)


TestPriorityOrder = PriorityOrder.TestCase
TestPriorityOrder.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- named cases


class Gates:
    """A scripted runtime: each pull waits until the test lets it finish; starts in order."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Future[bytes]] = {}

    def runner(self, name: str):
        async def run() -> bytes:
            self.started.append(name)
            self.gates[name] = asyncio.get_running_loop().create_future()
            return await self.gates[name]
        return run

    def finish(self, name: str) -> None:
        self.gates[name].set_result(b"ok")


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def pull(s: PullScheduler, g: Gates, name: str, prio: int = 0, who: Priority = FG, image: str | None = None):
    return asyncio.ensure_future(s.pull(key(image or name), g.runner(name), priority=who,
                                        uid=1000 if who is U else None, pod_priority=prio))


async def test_a_critical_pod_queued_last_starts_next() -> None:
    s, g = PullScheduler(max_parallel=2), Gates()
    apps = [pull(s, g, f"app{i}") for i in range(6)]
    await settle()
    critical = pull(s, g, "cni", SYSTEM_NODE_CRITICAL)
    await settle()
    g.finish("app0")
    await settle()
    assert g.started == ["app0", "app1", "cni"]
    g.finish("cni")
    assert (await critical).response == b"ok"
    for t in apps:
        t.cancel()


async def test_same_pod_priority_oldest_first_and_higher_first() -> None:
    s, g = PullScheduler(max_parallel=1), Gates()
    tasks = [pull(s, g, "run"), pull(s, g, "low1", 5), pull(s, g, "high", 100), pull(s, g, "low2", 5)]
    await settle()
    for name in ("run", "high", "low1", "low2"):
        g.finish(name)
        await settle()
    assert g.started == ["run", "high", "low1", "low2"]
    await asyncio.gather(*tasks)


async def test_age_lifts_a_low_priority_pull_above_later_critical_ones() -> None:
    clock = Clock()
    s, g = PullScheduler(max_parallel=1, aging_seconds=30, clock=clock), Gates()
    tasks = [pull(s, g, "run"), pull(s, g, "old", 0)]
    await settle()
    clock.now += 29
    tasks.append(pull(s, g, "critical-early", SYSTEM_NODE_CRITICAL))
    await settle()
    g.finish("run")
    await settle()
    assert g.started[-1] == "critical-early"  # it came within 30 s of "old": its pod priority counts
    clock.now += 2  # "old" waited 31 s: one band above anything that came 30 s or more after it
    tasks.append(pull(s, g, "critical-late", SYSTEM_NODE_CRITICAL))
    await settle()
    g.finish("critical-early")
    await settle()
    g.finish("old")
    await settle()
    g.finish("critical-late")
    assert g.started == ["run", "critical-early", "old", "critical-late"]
    await asyncio.gather(*tasks)


async def test_a_joined_critical_caller_lifts_a_flight_and_leaving_lowers_it() -> None:
    s, g = PullScheduler(max_parallel=1), Gates()
    tasks = [pull(s, g, "run"), pull(s, g, "a"), pull(s, g, "b")]
    await settle()
    joined = asyncio.ensure_future(s.pull(key("b"), g.runner("b-joiner"), priority=FG, pod_priority=SYSTEM_NODE_CRITICAL))
    await settle()
    assert [r["pod_priority"] for r in s.snapshot()["queued"]] == [0, SYSTEM_NODE_CRITICAL]
    joined.cancel()
    await settle()
    assert [r["pod_priority"] for r in s.snapshot()["queued"]] == [0, 0]
    g.finish("run")
    await settle()
    assert g.started == ["run", "a"]  # "b" is back behind "a", at its own place
    joined2 = asyncio.ensure_future(s.pull(key("b"), g.runner("x"), priority=FG, pod_priority=1))
    await settle()
    g.finish("a")
    await settle()
    g.finish("b")
    await asyncio.gather(*tasks, joined2)


async def test_untrusted_and_prefetch_callers_bring_no_pod_priority() -> None:
    s, g = PullScheduler(max_parallel=4, background_max_parallel=1), Gates()
    tasks = [pull(s, g, f"run{i}") for i in range(4)]
    await settle()
    tasks += [pull(s, g, "u1", SYSTEM_NODE_CRITICAL, U), pull(s, g, "bg", SYSTEM_NODE_CRITICAL, BG),
              pull(s, g, "fg", 0)]
    await settle()
    g.finish("run0")
    await settle()
    assert g.started[-1] == "fg"  # trusted first, whatever pod priority the others claimed
    rows = {r["image"]: r for r in s.snapshot()["queued"]}
    assert "pod_priority" not in rows["u1"] and "pod_priority" not in rows["bg"]
    for t in tasks:
        t.cancel()


async def test_priority_order_off_is_arrival_order() -> None:
    s, g = PullScheduler(max_parallel=1, priority_order=False), Gates()
    tasks = [pull(s, g, "run"), pull(s, g, "app"), pull(s, g, "cni", SYSTEM_NODE_CRITICAL)]
    await settle()
    for name in ("run", "app", "cni"):
        g.finish(name)
        await settle()
    assert g.started == ["run", "app", "cni"]
    await asyncio.gather(*tasks)


async def test_critical_slot_starts_a_critical_pod_beyond_the_cap_and_nothing_else() -> None:
    s, g = PullScheduler(max_parallel=2, critical_slots=1), Gates()
    tasks = [pull(s, g, "app0"), pull(s, g, "app1"), pull(s, g, "app2", 1000), pull(s, g, "u", 0, U)]
    await settle()
    assert g.started == ["app0", "app1"]
    tasks += [pull(s, g, "node", SYSTEM_NODE_CRITICAL), pull(s, g, "cluster", SYSTEM_CLUSTER_CRITICAL)]
    await settle()
    assert g.started == ["app0", "app1", "node"]  # one extra slot, taken: "cluster" waits for it
    assert s.running.held == 3 and s.slots.describe()["critical_slots"] == 1
    g.finish("node")
    await settle()
    assert g.started[-1] == "cluster"
    for t in tasks:
        t.cancel()


# ---------------------------------------------------------------------- the resolver


def sandbox(namespace: str = "default", name: str = "p", labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(name=name, namespace=namespace, uid="u1"),
                                    labels=labels or {}, annotations=annotations or {})


class Lookup:
    def __init__(self, known: dict[tuple[str, str, str], int]) -> None:
        self.known = known

    def priority_of(self, namespace: str, name: str, uid: str) -> int | None:
        return self.known.get((namespace, name, uid))


def test_default_rules_make_static_pods_node_critical() -> None:
    r = PodPriority(from_dict({}).pulls.priority_rules)
    assert r.of(sandbox(annotations={"kubernetes.io/config.source": "file"})) == SYSTEM_NODE_CRITICAL
    assert r.of(sandbox(annotations={"kubernetes.io/config.source": "api"})) == 0
    assert r.of(sandbox()) == 0
    assert r.of(api_pb2.PodSandboxConfig()) == 0


def test_rules_by_namespace_and_labels_highest_wins() -> None:
    cfg = from_dict({"pulls": {"priority_rules": [
        {"priority": "system-cluster-critical", "namespaces": ["kube-system"]},
        {"priority": 1000, "pod_labels": {"tier": "gold"}},
        {"priority": "system-node-critical", "namespaces": ["kube-system"], "pod_labels": {"k8s-app": "cni"}},
    ]}})
    r = PodPriority(cfg.pulls.priority_rules)
    assert r.of(sandbox("kube-system")) == SYSTEM_CLUSTER_CRITICAL
    assert r.of(sandbox("kube-system", labels={"k8s-app": "cni", "tier": "gold"})) == SYSTEM_NODE_CRITICAL
    assert r.of(sandbox("apps", labels={"tier": "gold"})) == 1000
    assert r.of(sandbox("apps", labels={"k8s-app": "cni"})) == 0
    assert r.of(sandbox(annotations={"kubernetes.io/config.source": "file"})) == 0  # the list replaced the default


def test_the_lookup_decides_when_it_knows_the_pod_and_a_rule_only_raises_it() -> None:
    r = PodPriority([PriorityRule(1000, namespaces=("kube-system",))])
    assert r.of(sandbox("kube-system", "cni")) == 1000
    r.use_lookup(Lookup({("kube-system", "cni", "u1"): SYSTEM_NODE_CRITICAL, ("kube-system", "dns", "u1"): 7,
                         ("apps", "web", "u1"): 2000, ("apps", "low", "u1"): -5}))
    assert r.of(sandbox("kube-system", "cni")) == SYSTEM_NODE_CRITICAL  # the API's, above the rule
    assert r.of(sandbox("kube-system", "dns")) == 1000  # the rule raises the API's 7
    assert r.of(sandbox("apps", "web")) == 2000
    assert r.of(sandbox("apps", "low")) == -5  # no rule: the API's, negative included
    assert r.of(sandbox("kube-system", "other")) == 1000  # unknown to the API: the rules
    r.use_lookup(None)  # the cluster source stopped: the rules alone
    assert r.of(sandbox("apps", "web")) == 0


@pytest.mark.parametrize("rules, key", [
    ([{"priority": "very-important"}], "pulls.priority_rules[0].priority"),
    ([{"priority": 3000000000}], "pulls.priority_rules[0].priority"),
    ([{"namespaces": ["a"]}], "pulls.priority_rules[0].priority"),
    ([{"priority": 1, "nodes": ["a"]}], "pulls.priority_rules[0].nodes"),
    ({"priority": 1}, "pulls.priority_rules"),
])
def test_a_bad_rule_names_its_key(rules: object, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"pulls": {"priority_rules": rules}})
    assert key in str(e.value)


def test_aging_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="pulls.priority_aging_seconds"):
        from_dict({"pulls": {"priority_aging_seconds": 0}})
