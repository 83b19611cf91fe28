"""Callers that give up: cancelled or timed out at random while their pull is queued,
joined to another caller's pull, or in flight. The shim runs as a process (both
engines) in front of a scripted runtime that counts its concurrent pulls.

The cap holds in the runtime, no slot leaks (the pull gauges are 0 at the end),
and every caller that waited got the answer of its own pull. The long version of
this run is in tests/soak.
"""

from __future__ import annotations


from tests.support.fixtures import shim_factory  # noqa: F401  (fixture)
from tests.support.pull_chaos import PULL, ScriptedPulls, settled_gauges, storm
from tests.support.registry import free_port

CAP = 3


async def test_random_cancels_and_deadlines_keep_the_cap_and_leak_no_slot(runtime, shim_factory, engine) -> None:
    pulls = ScriptedPulls(mean_seconds=0.03)
    runtime.unary[PULL] = pulls
    port = free_port()
    shim = shim_factory({"pulls": {"max_parallel": CAP}, "metrics": {"address": f"127.0.0.1:{port}"},
                         "server": {"engine": engine, "admin_socket": ""}},
                        upstream=runtime.path, log_level="info")
    tally = await storm(shim.endpoint, callers=400, seed=7)
    gauges = await settled_gauges(port)
    print(f"\n[{engine}] {tally.callers} callers in {tally.seconds:.1f}s: {dict(sorted(tally.outcomes.items()))}; "
          f"runtime pulls {pulls.calls} (cancelled there {pulls.cancelled}), at most {pulls.max_active} at once; "
          f"gauges after: {gauges}")
    assert sum(tally.outcomes.values()) == tally.callers  # every caller got an answer
    assert tally.wrong == []  # ... and every one that waited got its own pull's answer
    assert tally.survivors() > 100
    assert {k for k in tally.outcomes if k.startswith("wait:")} <= {"wait:OK", "wait:NOT_FOUND"}
    assert tally.outcomes["deadline:DEADLINE_EXCEEDED"] > 0 and tally.outcomes["cancel:CANCELLED"] > 0
    assert pulls.max_active == CAP  # reached, never passed
    assert pulls.active == 0
    assert gauges == {"cri_shim_pulls_in_flight": 0.0, "cri_shim_pull_queue_length": 0.0}
    assert shim.running
