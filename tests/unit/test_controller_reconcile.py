"""The controller's reconcilers and loop (shim/controller/imageset.py, pinned.py, manager.py) in the
style of sample-controller's controller_test.go: a fixture seeds the informers' caches (Nodes,
ImageSets, NodeImageSetStatuses), runs one reconcile through the manager's ``process`` (the
queue's get, reconcile, forget / add_rate_limited / add_after, done) and compares the exact
actions sent to a fake applier with the expected ones. Time is the fixture's clock: the queue's
and the reconciler's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kubernetes_asyncio.client import ApiClient

from shim.controller import truth
from shim.controller.apply import WriteError
from shim.controller.imageset import ImageSetReconciler
from shim.controller.leader import LeaderElector
from shim.controller.manager import Manager, new_queue, process
from shim.controller.pinned import PinnedImageSetReconciler
from shim.controller.workqueue import ItemBackoff, WorkQueue
from shim.cluster.objects import Kind
from tests.support.fake_lease import FakeLock

T0 = 1_800_000_000.0
STALE = 120.0


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def nis(name: str, wrote: float, *rows: dict[str, Any]) -> dict[str, Any]:
    """A node's NodeImageSetStatus, written by its shim at ``wrote``."""
    return {"metadata": {"name": name, "creationTimestamp": truth.format_time(T0 - 3600),
                         "managedFields": [{"manager": "cri-shim", "operation": "Apply",
                                            "time": truth.format_time(wrote)}]},
            "status": {"sets": list(rows)}}


def row(desired: str, current: str | None = None, name: str = "s", **kw: Any) -> dict[str, Any]:
    return {"name": name, "desiredGeneration": desired, **({"currentGeneration": current} if current else {}), **kw}


def image_set(name: str = "s", generation: int = 2, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "generation": generation, "uid": f"uid-{name}"},
            "spec": {"nodeSelector": {"matchLabels": {"pool": "gpu"}}, **spec}}


class FakeApplier:
    """Records every write (``actions``); ``fail`` makes the next writes raise."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, str, bool, dict[str, Any]]] = []
        self.fail = 0

    async def apply(self, kind: Kind, name: str, body: dict[str, Any], *, status: bool, what: str) -> None:
        self.actions.append((kind.kind, name, status, body))
        if self.fail:
            self.fail -= 1
            raise WriteError(what, name, ConnectionResetError("connection reset by peer"))


class Fixture:
    def __init__(self) -> None:
        self.now = T0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.sets: dict[str, dict[str, Any]] = {}
        self.statuses: dict[str, dict[str, Any]] = {}
        self.applier = FakeApplier()
        self.leading = True
        self.queue: WorkQueue[str] = WorkQueue(ItemBackoff(0.005, 30.0), clock=self.clock)
        self.reconciler = ImageSetReconciler(
            nodes=SimpleNamespace(items=self.nodes), sets=SimpleNamespace(items=self.sets),  # type: ignore[arg-type]
            statuses=SimpleNamespace(items=self.statuses), applier=self.applier,  # type: ignore[arg-type]
            leading=lambda: self.leading, stale_after=STALE, clock=self.clock)

    def clock(self) -> float:
        return self.now

    def seed(self, *, nodes: list[dict[str, Any]] = [], sets: list[dict[str, Any]] = [],  # noqa: B006
             statuses: list[dict[str, Any]] = []) -> None:  # noqa: B006
        for cache, objs in ((self.nodes, nodes), (self.sets, sets), (self.statuses, statuses)):
            cache.update({o["metadata"]["name"]: o for o in objs})

    def run(self, name: str = "s") -> list[tuple[str, str, bool, dict[str, Any]]]:
        """Queue ``name``, take it as the manager's loop does, process it; the actions it sent."""
        before = len(self.applier.actions)
        self.queue.add(name)
        assert self.queue.get_nowait() == name
        asyncio.run(process(self.queue, self.reconciler, name))
        return self.applier.actions[before:]

    def due(self) -> list[str]:
        """What the queue hands out now (each processed at once after)."""
        out = []
        while (name := self.queue.get_nowait()) is not None:
            out.append(name)
            self.queue.done(name)
        return out


def status_action(name: str, status: dict[str, Any]) -> tuple[str, str, bool, dict[str, Any]]:
    return ("ImageSet", name, True, {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
                                     "status": status})


def condition(type_: str, status: str, reason: str, message: str, at: float = T0) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": truth.format_time(at), "observedGeneration": 2}


NO_PRESSURE = condition("DiskPressure", "False", "BelowThreshold",
                        "no selected node holds prefetch below kubelet's image GC threshold")


def expected_status(*, current: int, progressing: int, stale: int, missing: int, extra: dict[str, Any],
                    conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"observedGeneration": 2, "selected": 3, "current": current, "progressing": progressing, "failing": 0,
            "stale": stale, "missing": missing, "rolloutStartTime": truth.format_time(T0), **extra,
            "conditions": conditions}


def three_nodes(f: Fixture, set_: dict[str, Any]) -> None:
    """a current, b still at generation 1 (its shim wrote 10 s ago), c with no status object."""
    f.seed(nodes=[node("a", pool="gpu"), node("b", pool="gpu"), node("c", pool="gpu"), node("x", pool="cpu")],
           sets=[set_], statuses=[nis("a", T0 - 10, row("2", "2")), nis("b", T0 - 10, row("1", "1"))])


PULLING = expected_status(
    current=1, progressing=1, stale=0, missing=1, extra={"missingNodes": ["c"]},
    conditions=[condition("Available", "False", "NodesNotCurrent", "1 of 3 selected nodes current"),
                condition("Progressing", "True", "NodesPulling",
                          "1 node(s) pulling or catching up; 1 of 3 selected nodes current"),
                condition("Degraded", "True", "NodesMissing", "1 selected node(s) without any report: c"),
                NO_PRESSURE])


def test_status_written_once_with_the_counts_and_not_again_when_nothing_changed() -> None:
    f = Fixture()
    three_nodes(f, image_set())
    assert f.run() == [status_action("s", PULLING)]
    assert f.run() == []  # the same status: no write
    # b silent since T0 - 10, its generation first seen at T0: looked at again when it turns stale
    assert f.queue.waiting() == {"s": T0 + STALE + 0.05}


def test_an_apply_error_is_retried_with_the_sets_backoff_then_forgotten() -> None:
    f = Fixture()
    three_nodes(f, image_set())
    f.applier.fail = 2
    assert f.run() == [status_action("s", PULLING)]  # sent, refused
    assert f.queue.num_requeues("s") == 1 and f.queue.waiting() == {"s": T0 + 0.005}
    assert f.due() == []  # not before its backoff
    f.now += 0.005
    assert f.due() == ["s"]
    assert f.run() == [status_action("s", PULLING)]  # refused again: the backoff doubles
    assert f.queue.waiting() == {"s": f.now + 0.01} and f.queue.num_requeues("s") == 2
    f.now += 0.01
    assert f.run() == [status_action("s", PULLING)]  # written
    assert f.queue.num_requeues("s") == 0  # forgotten on success: the next failure starts at 5 ms again
    assert f.queue.waiting() == {"s": T0 + STALE + 0.05}  # and the stale check is queued
    assert f.run() == []


def test_a_node_turning_stale_is_seen_at_its_requeue_after() -> None:
    f = Fixture()
    three_nodes(f, image_set())
    f.run()
    f.now = T0 + STALE  # nothing changed: b's shim is silent
    assert f.due() == []
    f.now = T0 + STALE + 0.05
    assert f.due() == ["s"]
    assert f.run() == [status_action("s", expected_status(
        current=1, progressing=0, stale=1, missing=1, extra={"missingNodes": ["c"], "staleNodes": ["b"]},
        conditions=[condition("Available", "False", "NodesNotCurrent", "1 of 3 selected nodes current"),
                    condition("Progressing", "False", "Idle", "1 of 3 selected nodes current", at=f.now),
                    condition("Degraded", "True", "NodesStale", "1 node(s) behind with a silent shim: b"),
                    NO_PRESSURE]))]
    assert f.queue.waiting() == {}  # nobody left to turn stale


def test_a_paced_set_grants_the_next_node_as_one_turns_current() -> None:
    f = Fixture()
    f.seed(nodes=[node(n, pool="gpu") for n in "abc"], sets=[image_set(rollout={"maxConcurrentNodes": 1})],
           statuses=[nis(n, T0 - 10, row("1", "1")) for n in "abc"])
    (action,) = f.run()
    rollout = action[3]["status"]["rollout"]
    assert (rollout["granted"], rollout["inFlight"], rollout["phase"]) == (["a"], 1, "Rolling")
    f.now += 5
    f.statuses["a"] = nis("a", f.now, row("2", "2"))  # a reports the generation: its slot frees
    (action,) = f.run()
    status = action[3]["status"]
    assert (status["current"], status["rollout"]["granted"], status["rollout"]["inFlight"]) == (1, ["b"], 1)


def test_a_standby_computes_but_never_writes_and_a_deleted_set_is_forgotten() -> None:
    f = Fixture()
    three_nodes(f, image_set())
    f.leading = False
    assert f.run() == [] and f.reconciler.recomputes == 1
    f.leading = True
    del f.sets["s"]
    assert f.run() == []
    f.now = T0 + STALE + 1  # the stale check it had asked for comes: nothing written, nothing asked again
    assert f.run() == [] and f.queue.waiting() == {}


def test_pinned_image_set_reconciler_writes_its_report_and_requeues_for_staleness() -> None:
    f = Fixture()
    f.seed(nodes=[node("a", pool="gpu"), node("b", pool="gpu")],
           statuses=[nis("a", T0 - 10, row("2", "2", name="p", kind="PinnedImageSet")),
                     nis("b", T0 - 10, row("1", "1", name="p", kind="PinnedImageSet"))])
    pis = {"apiVersion": "machineconfiguration.openshift.io/v1", "kind": "PinnedImageSet",
           "metadata": {"name": "p", "generation": 2, "uid": "uid-p"}, "spec": {"pinnedImages": []}}
    pool = {"metadata": {"name": "worker"},
            "spec": {"nodeSelector": {"matchLabels": {"pool": "gpu"}}, "pinnedImageSets": [{"name": "p"}]}}
    watch = SimpleNamespace(sets={"p": pis}, pools=[pool], reports={})
    r = PinnedImageSetReconciler(watch, nodes=SimpleNamespace(items=f.nodes),  # type: ignore[arg-type]
                                 statuses=SimpleNamespace(items=f.statuses), applier=f.applier,  # type: ignore[arg-type]
                                 leading=lambda: True, stale_after=STALE, clock=f.clock)
    f.queue.add("p")
    assert f.queue.get_nowait() == "p"
    asyncio.run(process(f.queue, r, "p"))
    ((kind, name, status, body),) = f.applier.actions
    assert (kind, name, status) == ("PinnedImageSetReport", "p", False)
    assert body["metadata"]["ownerReferences"][0]["uid"] == "uid-p" and body["status"]["machineConfigPools"] == ["worker"]
    assert (body["status"]["selected"], body["status"]["current"], body["status"]["progressing"]) == (2, 1, 1)
    assert f.queue.waiting() == {"p": T0 + STALE + 0.05}  # b turns stale then if it stays silent


# ---------------------------------------------------------------------- the manager's events and loop

def manager() -> Manager:
    elector = LeaderElector(FakeLock(), identity="me", lease_duration=0.6, renew_deadline=0.4, retry_period=0.1)
    m = Manager(ApiClient(), elector, batch_interval=0.05)
    return m


async def test_each_event_queues_the_sets_it_concerns() -> None:
    m = manager()
    m.sets.items.update({"gpu": image_set("gpu"), "cpu": {**image_set("cpu"), "spec": {
        "nodeSelector": {"matchLabels": {"pool": "cpu"}}}}, "other": image_set("other")})
    m.sets.items["other"]["spec"]["nodeSelector"] = {"matchLabels": {"pool": "none"}}
    m.nodes.items["n"] = node("n", pool="gpu")
    m.on_node_event("MODIFIED", node("n", pool="gpu"), node("n", pool="gpu"))  # a heartbeat
    assert m.queue.queued() == set()
    m.on_node_event("MODIFIED", node("n", pool="cpu"), node("n", pool="gpu"))  # relabelled
    assert m.queue.queued() == {"gpu", "cpu"}
    m.queue = new_queue()
    m.on_status_event("MODIFIED", None, nis("n", T0, row("1", name="other")))  # its rows and its node's sets
    assert m.queue.queued() == {"other", "gpu"}
    m.queue = new_queue()
    m.on_set_event("DELETED", image_set("cpu"), None)  # its reconcile forgets it
    assert m.queue.queued() == {"cpu"}
    m.on_set_event("LIST", None, None)
    assert m.queue.queued() == {"gpu", "cpu", "other"}
    await m.reach.stop()
    await m.api.close()


async def test_the_leaders_loop_writes_each_set_once_per_batch_and_retries_a_failed_write() -> None:
    m = manager()
    applier = FakeApplier()
    m.imagesets.applier = applier
    for inf in (m.nodes, m.sets, m.statuses):
        inf.synced = True
    m.nodes.items.update({n: node(n, pool="gpu") for n in "ab"})
    m.sets.items.update({"s": image_set(), "t": image_set("t")})
    applier.fail = 1  # the first write of the first batch ("s", in name order)
    elector = m.elector
    task = asyncio.get_running_loop().create_task(elector.run(m.lead))
    try:
        for _ in range(200):
            if len(applier.actions) >= 3:
                break
            await asyncio.sleep(0.01)
        for _ in range(20):  # events while leading: every node's status changes 20 times within a batch or two
            m.on_status_event("MODIFIED", None, nis("a", T0, row("2", "1")))
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await m.reach.stop()
        await m.api.close()
    names = [name for _, name, _, _ in applier.actions]
    assert names[:3] == ["s", "t", "s"]  # s refused, t written, s written after its backoff
    assert len(names) == 3  # the status events changed nothing the sets show: no write
    assert m.imagesets.recomputes <= 3 + 2 * 8  # the 20 events cost a few batches, not 20 recomputes per set


def test_a_set_created_again_under_its_name_starts_afresh() -> None:
    f = Fixture()
    three_nodes(f, image_set())
    f.run()
    f.now += 30
    f.sets["s"] = {**image_set(), "metadata": {"name": "s", "generation": 2, "uid": "uid-s-again"}}  # no status
    (action,) = f.run()  # the deletion was never seen (a re-list): what was written for the old object is not kept
    assert action[3]["status"]["rolloutStartTime"] == truth.format_time(f.now)
