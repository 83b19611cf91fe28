"""Property: under random cancels, timeouts, errors and slot releases (the slot lease) the
cap holds for the pulls that hold a slot, no slot leaks, and every caller that stays gets
an answer (the runtime's or its own deadline)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.errors import RpcError
from shim.pulls.scheduler import Priority, PullKey, PullScheduler

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from("abcdef"),                          # image
        st.sampled_from(["", "cred1"]),                     # auth hash
        st.sampled_from(list(Priority)),
        st.sampled_from(["ok", "error", "cancel", "timeout", "slow"]),
        st.integers(min_value=0, max_value=5),              # upstream delay (event-loop steps)
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(actions=ACTIONS, cap=st.integers(min_value=2, max_value=4), bg_cap=st.integers(min_value=1, max_value=2),
       seed=st.integers(0, 2**16))
def test_cap_holds_and_queue_drains(actions, cap: int, bg_cap: int, seed: int) -> None:
    """(cap 1 runs no background pull: the last slot is foreground's; config refuses it with image sets.)"""
    asyncio.run(_scenario(actions, cap, bg_cap, random.Random(seed)))


async def _settle(done: Callable[[], bool], steps: int = 10_000) -> None:
    """Let the event loop run until ``done()``; fail if it never gets there."""
    for _ in range(steps):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the scheduler did not settle")


async def _scenario(actions, cap: int, bg_cap: int, rnd: random.Random) -> None:
    s = PullScheduler(max_parallel=cap, background_max_parallel=bg_cap)
    active = {"n": 0, "max": 0, "held": 0, "released": 0}
    slow_gate = asyncio.Event()  # "slow" pulls hold their slot until the end of the scenario

    def runner(image: str, behaviour: str, delay_steps: int):
        async def run() -> bytes:
            active["n"] += 1
            active["max"] = max(active["max"], active["n"])
            assert len(s.holding) <= cap and s.in_flight <= cap + active["released"]
            assert sum(f.priority is Priority.BACKGROUND for f in s.holding) < cap  # one slot is foreground's
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

    async def caller(image, auth, prio, behaviour, delay):
        timeout = 0.002 if behaviour == "timeout" else None
        try:
            out = await s.pull(PullKey(image, auth=auth), runner(image, behaviour, delay), priority=prio,
                               timeout=timeout)
            return ("ok", out.response)
        except RpcError as e:
            return ("err", e.code)

    tasks = []
    for image, auth, prio, behaviour, delay in actions:
        t = asyncio.create_task(caller(image, auth, prio, behaviour, delay))
        tasks.append((t, behaviour))
        if rnd.random() < 0.5:
            await asyncio.sleep(0)
        if rnd.random() < 0.2 and s.holding:  # the lease ends for a running pull (lease.py)
            active["released"] += s.release(rnd.choice(s.holding), "progress not judged")
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
    slow_gate.set()
    results = await asyncio.wait_for(asyncio.gather(*(t for t, _ in tasks), return_exceptions=True), 10)
    await _settle(lambda: s.in_flight == 0 and s.queued == 0 and active["n"] == 0)
    assert active["max"] <= cap + active["released"]
    assert not s._flights  # nothing left behind
    for r in results:
        assert isinstance(r, (tuple, asyncio.CancelledError))
        if isinstance(r, tuple) and r[0] == "err":
            assert r[1] in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)
