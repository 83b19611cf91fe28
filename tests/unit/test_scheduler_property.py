"""Property: under random cancels, timeouts, errors and slot releases (the slot lease) the
slot rule (shim/pulls/slots.py) holds at every moment: the cap for the pulls that hold a
slot, twice the cap for all pulls running in the runtime, the untrusted share (and one
uid's part of it) and prefetch's sub-cap counting released pulls too, never the last slot
for untrusted and background pulls together, and a trusted pull queued only while another
trusted pull runs. No slot leaks, and every caller that stays gets an answer (the
runtime's, its own deadline, or the refusal of an untrusted pull when the cap is 1)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri.deadline import Deadline
from shim.errors import RpcError
from shim.pulls.scheduler import PullKey, PullScheduler
from shim.pulls.slots import Priority, Slots

# A caller: its class and, for an untrusted one, its uid.
CALLERS = [(Priority.FOREGROUND, None), (Priority.BACKGROUND, None),
           (Priority.UNTRUSTED, 1000), (Priority.UNTRUSTED, 1001), (Priority.UNTRUSTED, 1002)]

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from("abcdef"),                          # image
        st.sampled_from(["", "cred1"]),                     # auth hash
        st.sampled_from(CALLERS),
        st.sampled_from(["ok", "error", "cancel", "timeout", "slow"]),
        st.integers(min_value=0, max_value=5),              # upstream delay (event-loop steps)
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(actions=ACTIONS, cap=st.integers(min_value=1, max_value=5), bg_cap=st.integers(min_value=1, max_value=2),
       share=st.sampled_from([0.25, 0.5, 1.0]), per_uid=st.integers(min_value=1, max_value=3),
       lease_ends=st.sampled_from([0.2, 0.9]), seed=st.integers(0, 2**16))
def test_slot_rule_holds_and_queue_drains(actions, cap: int, bg_cap: int, share: float, per_uid: int,
                                          lease_ends: float, seed: int) -> None:
    """(cap 1 runs no background or untrusted pull: the last slot is trusted pulls'; config
    refuses it with image sets.)"""
    slots = Slots(cap, bg_cap, share, per_uid)
    if cap == 1:
        actions = [a for a in actions if a[2][0] is not Priority.BACKGROUND]
    asyncio.run(_scenario(actions, slots, lease_ends, random.Random(seed)))


def check_slot_rule(s: PullScheduler) -> None:
    """The slot rule, as the runtime sees it now."""
    slots, running = s.slots, s.running
    n = slots.max_parallel
    assert running.held == len(s.holding) <= n
    assert running.total == s.in_flight <= 2 * n
    assert running.untrusted <= (slots.untrusted_slots or 0)
    assert all(k <= slots.per_uid_slots for k in running.by_uid.values())
    assert running.background <= slots.background_slots
    assert running.untrusted + running.background <= n - 1
    if any(row["priority"] == "foreground" for row in s.snapshot()["queued"]):
        assert running.trusted >= 1  # a trusted pull waits only for other trusted pulls


async def _settle(done: Callable[[], bool], steps: int = 10_000) -> None:
    """Let the event loop run until ``done()``; fail if it never gets there."""
    for _ in range(steps):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the scheduler did not settle")


async def _scenario(actions, slots: Slots, lease_ends: float, rnd: random.Random) -> None:
    cap = slots.max_parallel
    s = PullScheduler(max_parallel=cap, background_max_parallel=slots.background_max_parallel,
                      untrusted_share=slots.untrusted_share, max_parallel_per_uid=slots.max_parallel_per_uid)
    active = {"n": 0, "max": 0, "held": 0, "released": 0}
    slow_gate = asyncio.Event()  # "slow" pulls hold their slot until the end of the scenario

    def runner(image: str, behaviour: str, delay_steps: int):
        async def run() -> bytes:
            active["n"] += 1
            active["max"] = max(active["max"], active["n"])
            assert len(s.holding) <= cap and s.in_flight <= cap + active["released"]
            check_slot_rule(s)
            try:
                for _ in range(delay_steps):
                    await asyncio.sleep(0)
                if behaviour == "slow":
                    active["held"] += 1
                    try:
                        await slow_gate.wait()
                    finally:
                        active["held"] -= 1
                if behaviour == "error":
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"{image} not found", from_upstream=True)
                return image.encode()
            finally:
                active["n"] -= 1
        return run

    async def caller(image, auth, who, behaviour, delay):
        prio, uid = who
        timeout = 0.002 if behaviour == "timeout" else None
        try:
            out = await s.pull(PullKey(image, auth=auth), runner(image, behaviour, delay), priority=prio, uid=uid,
                               deadline=Deadline.after(timeout))
            return ("ok", out.response)
        except RpcError as e:
            return ("err", e.code)

    tasks = []
    for image, auth, prio, behaviour, delay in actions:
        t = asyncio.create_task(caller(image, auth, prio, behaviour, delay))
        tasks.append((t, behaviour))
        if rnd.random() < 0.5:
            await asyncio.sleep(0)
        if rnd.random() < lease_ends and s.holding:  # the lease ends for a running pull (lease.py)
            active["released"] += s.release(rnd.choice(s.holding), "progress not judged")
        check_slot_rule(s)
    for t, behaviour in tasks:
        if behaviour == "cancel" and rnd.random() < 0.8:
            t.cancel()
        await asyncio.sleep(0)
    # Callers with a deadline finish while the slow pulls still hold their slots.
    deadlined = [t for t, behaviour in tasks if behaviour == "timeout"]
    if deadlined:
        await asyncio.wait(deadlined, timeout=10)
    assert all(t.done() for t in deadlined)
    assert active["held"] <= s.in_flight <= cap + active["released"] and len(s.holding) <= cap
    check_slot_rule(s)
    slow_gate.set()
    results = await asyncio.wait_for(asyncio.gather(*(t for t, _ in tasks), return_exceptions=True), 10)
    await _settle(lambda: s.in_flight == 0 and s.queued == 0 and active["n"] == 0)
    assert active["max"] <= cap + active["released"]
    assert not s.flights()  # nothing left behind
    for r in results:
        assert isinstance(r, (tuple, asyncio.CancelledError))
        if isinstance(r, tuple) and r[0] == "err":
            assert r[1] in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED) or (
                r[1] is grpc.StatusCode.RESOURCE_EXHAUSTED and slots.untrusted_slots == 0)
