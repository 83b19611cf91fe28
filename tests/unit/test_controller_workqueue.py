"""shim/controller/workqueue.py, client-go's workqueue rules: an item queued once however often it
is added, never handed to two workers at once, added again while processing means processed again
after; add_after on the queue's clock (the earlier time wins); per-item backoff that doubles to its
cap and that forget resets; shutdown ends the waits. The rules as a hypothesis state machine over
random add / add_after / add_rate_limited / get / done / forget / time sequences."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shim.controller.workqueue import ItemBackoff, ShutDown, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_add_dedups_and_an_item_in_processing_is_processed_again_after_done() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("b")
    q.add("a")
    assert len(q) == 2
    assert q.get_nowait() == "a"
    q.add("a")  # changed while processed: not handed out again now
    assert q.get_nowait() == "b"
    assert q.get_nowait() is None
    q.done("b")
    q.done("a")  # ... but at done
    assert q.get_nowait() == "a"
    q.done("a")
    assert q.get_nowait() is None


def test_add_after_on_the_queue_clock_earlier_time_wins() -> None:
    clock = Clock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 10.0)
    q.add_after("a", 3.0)  # earlier: replaces
    q.add_after("a", 7.0)  # later: ignored
    clock.t += 2.9
    assert q.get_nowait() is None
    clock.t += 0.2
    assert q.get_nowait() == "a"
    q.done("a")
    clock.t += 10.0
    assert q.get_nowait() is None  # the replaced times never add it again
    q.add_after("b", 0)  # no delay: at once
    assert q.get_nowait() == "b"


def test_backoff_doubles_per_item_to_its_cap_and_forget_resets_it() -> None:
    clock = Clock()
    q: WorkQueue[str] = WorkQueue(ItemBackoff(0.005, 0.04), clock=clock)
    delays = []
    for _ in range(6):
        q.add_rate_limited("a")
        due = q.waiting()["a"]
        delays.append(round(due - clock.t, 6))
        clock.t = due - 1e-6
        assert q.get_nowait() is None  # not before its time
        clock.t = due
        assert q.get_nowait() == "a"
        q.done("a")
    assert delays == [0.005, 0.01, 0.02, 0.04, 0.04, 0.04]
    assert q.num_requeues("a") == 6 and q.num_requeues("b") == 0  # per item
    q.forget("a")
    assert q.num_requeues("a") == 0
    q.add_rate_limited("a")
    assert q.waiting() == {"a": pytest.approx(clock.t + 0.005)}


async def test_get_waits_for_an_item_or_its_time_and_shutdown_ends_the_wait() -> None:
    q: WorkQueue[str] = WorkQueue()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    q.add_after("a", 0.1)
    assert await asyncio.wait_for(q.get(), 2) == "a"
    assert loop.time() - t0 >= 0.09
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0.02)
    assert not waiter.done()
    q.add("b")
    assert await asyncio.wait_for(waiter, 2) == "b"
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0.02)
    q.add_after("c", 5.0)
    q.shutdown()
    with pytest.raises(ShutDown):
        await asyncio.wait_for(waiter, 2)
    q.add("d")
    assert q.get_nowait() is None and q.waiting() == {}


ITEMS = st.sampled_from(["a", "b", "c"])


class QueueMachine(RuleBasedStateMachine):
    """A model of what each item is owed: ``ready`` (added, or its delayed time came, since it was
    last handed out) and ``waiting`` (the earliest delayed time asked, not yet come; a later one
    asked meanwhile is served by it). Workers take items and end them in any order."""

    BASE, CAP = 0.005, 0.08

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.q: WorkQueue[str] = WorkQueue(ItemBackoff(self.BASE, self.CAP), clock=self.clock)
        self.ready: set[str] = set()
        self.waiting: dict[str, float] = {}
        self.held: list[str] = []  # taken by a worker, not done
        self.failures: dict[str, int] = {}

    def _after(self, item: str, delay: float) -> None:
        if delay <= 0:
            self.ready.add(item)
        else:
            self.waiting[item] = min(self.waiting.get(item, float("inf")), self.clock.t + delay)

    @rule(item=ITEMS)
    def add(self, item: str) -> None:
        self.q.add(item)
        self.ready.add(item)

    @rule(item=ITEMS, delay=st.sampled_from([0.0, 0.003, 0.01, 0.05]))
    def add_after(self, item: str, delay: float) -> None:
        self.q.add_after(item, delay)
        self._after(item, delay)

    @rule(item=ITEMS)
    def add_rate_limited(self, item: str) -> None:
        n = self.failures.get(item, 0)
        self.failures[item] = n + 1
        assert self.q.num_requeues(item) == n
        self.q.add_rate_limited(item)
        self._after(item, min(self.CAP, self.BASE * 2 ** n))  # doubling per failure, to the cap

    @rule(item=ITEMS)
    def forget(self, item: str) -> None:
        self.q.forget(item)
        self.failures.pop(item, None)
        assert self.q.num_requeues(item) == 0

    @rule(dt=st.sampled_from([0.001, 0.004, 0.02, 0.1]))
    def tick(self, dt: float) -> None:
        self.clock.t += dt
        for item, when in list(self.waiting.items()):
            if when <= self.clock.t:
                del self.waiting[item]
                self.ready.add(item)

    @rule()
    def get(self) -> None:
        item = self.q.get_nowait()
        candidates = self.ready - set(self.held)
        if item is None:
            assert not candidates, (candidates, self.held)  # nothing added is lost or left behind
            return
        assert item not in self.held  # never two workers at once
        assert item in candidates  # never before its time, never unasked
        self.ready.discard(item)
        self.held.append(item)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, 10))
    def done(self, i: int) -> None:
        self.q.done(self.held.pop(i % len(self.held)))

    @invariant()
    def as_modelled(self) -> None:
        assert self.q.processing() == set(self.held)
        assert self.q.queued() <= self.ready | set(self.held)
        future = {i: w for i, w in self.q.waiting().items() if w > self.clock.t}
        assert future == pytest.approx(self.waiting)  # each delayed item waits until its earliest time


QueueMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_queue_machine = QueueMachine.TestCase
