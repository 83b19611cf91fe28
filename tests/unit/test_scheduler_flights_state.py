"""Stateful property of collapsed pulls (the join and priority rules of shim/pulls/scheduler.py):
random sequences of trusted (kubelet), untrusted (two other uids) and prefetch callers asking
for random spellings of one image (``localhost:5000/app`` four ways, with or without
credentials), slot leases ending, pulls completing or failing upstream, callers leaving.

After every step, for every caller still waiting, by what its flight sends upstream (the
request of the caller whose runner it runs) and where it waits:

* a trusted caller's flight sends a trusted caller's or prefetch's request with the very same
  key (spelling up to the implied ``:latest``, credentials, handler): never an untrusted
  caller's, never another spelling; queued, it waits in the trusted lane;
* a prefetch never waits in an untrusted caller's flight, nor in an untrusted lane, and waits
  only for a request of the image as it declared it (any credentials);
* an untrusted caller waits in a flight of its own key, never in a prefetch's;
* the slot rule holds (tests/unit/test_scheduler_property.py ``check_slot_rule``);

and every caller that is answered gets the answer of such a request (the scripted runtime
answers with the sender's id, also in its errors). At the end nothing is left behind.

CI runs a bounded number of sequences (``CRI_SHIM_FLIGHTS_EXAMPLES``); the soak
(tests/soak/test_flights_soak.py) runs many more, and longer ones.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass
from typing import Callable

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shim.errors import RpcError
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.key import PullKey, pull_key
from shim.pulls.scheduler import Flight, PullScheduler
from shim.pulls.slots import Priority
from tests.unit.test_scheduler_property import check_slot_rule

FG, U, BG = Priority.FOREGROUND, Priority.UNTRUSTED, Priority.BACKGROUND
# Spellings of one image (one normal form: localhost:5000/app:latest); the first two are one
# request to every runtime, the others are not (containerd's certs.d and localhost checks are
# case-sensitive).
SPELLINGS = ["localhost:5000/app", "localhost:5000/app:latest", "LOCALHOST:5000/app:latest", "Localhost:5000/app"]
# What the runtime pulls for each spelling: the first two are one request.
RUNTIME_PULLS = {"localhost:5000/app": "localhost:5000/app:latest", "localhost:5000/app:latest": "localhost:5000/app:latest",
                 "LOCALHOST:5000/app:latest": "LOCALHOST:5000/app:latest", "Localhost:5000/app": "Localhost:5000/app:latest"}
WHO = [(FG, None), (U, 65534), (U, 1000), (BG, None)]
EXAMPLES = int(os.environ.get("CRI_SHIM_FLIGHTS_EXAMPLES", "60"))  # the soak runs many more (tests/soak)


@dataclass(eq=False)
class Caller:
    id: int
    priority: Priority
    uid: int | None
    key: PullKey
    request: tuple[str, str]  # what the runtime would pull, with which credentials
    task: asyncio.Task[object]

    def listener(self, name: str, attributes: object) -> None:
        """Its progress listener: also how the test finds the flight it waits in."""


def key_of(spelling: str, auth: str) -> PullKey:
    req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=spelling))
    if auth:
        req.auth.username, req.auth.password = auth, "secret"
    return pull_key(req, "")


class Flights(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count()
        self.callers: dict[int, Caller] = {}
        self.runners: dict[object, Caller] = {}  # a runner -> the caller whose request it sends
        self.gates: dict[int, asyncio.Future[bytes]] = {}  # sender id -> its upstream call, running
        self.sent: list[int] = []  # the senders whose requests went upstream, in order
        self.s = PullScheduler(max_parallel=4)

    @initialize(cap=st.integers(min_value=2, max_value=5), bg=st.integers(min_value=1, max_value=2),
                per_uid=st.integers(min_value=1, max_value=2))
    def configure(self, cap: int, bg: int, per_uid: int) -> None:
        self.settle(lambda: self.s.configure(cap, min(bg, cap - 1), True, max_parallel_per_uid=per_uid))

    # ------------------------------------------------------------------ the event loop

    def settle(self, first: Callable[[], object] = lambda: None) -> None:
        """Call ``first`` in the event loop, then let it run until everything settled."""
        async def steps() -> None:
            first()
            for _ in range(20):
                await asyncio.sleep(0)
        self.loop.run_until_complete(steps())

    def runner(self, caller_id: int):
        async def run() -> bytes:
            self.sent.append(caller_id)
            gate = self.gates[caller_id] = self.loop.create_future()
            try:
                return await gate
            finally:
                self.gates.pop(caller_id, None)
        return run

    # ------------------------------------------------------------------ rules

    @rule(who=st.sampled_from(WHO), spelling=st.sampled_from(SPELLINGS), auth=st.sampled_from(["", "pod"]))
    def pull(self, who: tuple[Priority, int | None], spelling: str, auth: str) -> None:
        priority, uid = who
        cid = next(self.ids)
        k = key_of(spelling, auth)
        run = self.runner(cid)
        holder: list[Caller] = []

        async def call() -> object:
            c = holder[0]
            try:
                out = await self.s.pull(k, run, priority=priority, uid=uid, listener=c.listener)
            except RpcError as e:
                return e
            return out

        task = self.loop.create_task(call())
        c = Caller(cid, priority, uid, k, (RUNTIME_PULLS[spelling], auth), task)
        holder.append(c)
        self.callers[cid] = c
        self.runners[run] = c
        self.settle()

    @rule(data=st.data(), ok=st.booleans())
    def upstream_answers(self, data: st.DataObject, ok: bool) -> None:
        if not self.gates:
            return
        sender = data.draw(st.sampled_from(sorted(self.gates)))
        gate = self.gates[sender]
        if ok:
            gate.set_result(str(sender).encode())
        else:
            gate.set_exception(RpcError(grpc.StatusCode.NOT_FOUND, f"sender {sender}", from_upstream=True))
        self.settle()

    @rule(data=st.data())
    def caller_leaves(self, data: st.DataObject) -> None:
        waiting = sorted(c.id for c in self.callers.values() if not c.task.done())
        if not waiting:
            return
        self.settle(self.callers[data.draw(st.sampled_from(waiting))].task.cancel)

    @rule(data=st.data())
    def lease_ends(self, data: st.DataObject) -> None:
        holding = self.s.holding
        if holding:
            flight = data.draw(st.sampled_from(holding))
            self.settle(lambda: self.s.release(flight, "progress not judged"))

    # ------------------------------------------------------------------ what must hold

    def flights(self) -> list[Flight]:
        return [f for group in self.s.flights().values() for f in group]  # every queued and running flight

    def flight_of(self, c: Caller) -> Flight:
        found = [f for f in self.flights() if c.listener in f.listeners]
        assert len(found) == 1, f"caller {c.id} waits in {len(found)} flights"
        return found[0]

    def check_sender(self, c: Caller, sender: Caller) -> None:
        """``c`` got (or waits for) what ``sender``'s request brings."""
        if c.priority is FG:
            assert sender.priority in (FG, BG), f"trusted caller {c.id} waits for untrusted caller {sender.id}"
            assert sender.request == c.request, f"trusted caller {c.id} sent {c.request}, upstream got {sender.request}"
        elif c.priority is BG:
            assert sender.priority in (FG, BG), f"prefetch {c.id} waits for untrusted caller {sender.id}"
            assert sender.request[0] == c.request[0], f"prefetch {c.id} of {c.request} got {sender.request}"
        else:
            assert sender.priority in (FG, U) and sender.request == c.request

    @invariant()
    def every_waiting_caller_waits_for_a_request_it_may(self) -> None:
        for c in self.callers.values():
            if c.task.done():
                continue
            f = self.flight_of(c)
            self.check_sender(c, self.runners[f.run])
            if f.queued and c.priority is FG:
                assert f.priority is FG, f"trusted caller {c.id} queued in the {f.priority.name} lane"
            if f.queued and c.priority is BG:
                assert f.priority is not U, f"prefetch {c.id} queued in uid {f.uid}'s lane"
        for f in self.flights():
            mine = sum(1 for c in self.callers.values() if not c.task.done() and c.listener in f.listeners)
            assert f.waiters == mine

    @invariant()
    def every_answer_is_of_a_request_it_may_get(self) -> None:
        for c in self.callers.values():
            if not c.task.done() or c.task.cancelled():
                continue
            out = c.task.result()
            if isinstance(out, RpcError):
                if out.details.startswith("sender "):
                    self.check_sender(c, self.callers[int(out.details.split()[1])])
                else:
                    raise AssertionError(f"caller {c.id}: {out.code.name} {out.details}")
            else:
                self.check_sender(c, self.callers[int(out.response)])  # type: ignore[attr-defined]
                assert out.joined is (int(out.response) != c.id)  # type: ignore[attr-defined]

    @invariant()
    def slot_rule(self) -> None:
        check_slot_rule(self.s)

    def teardown(self) -> None:
        try:
            def leave() -> None:
                for c in self.callers.values():
                    c.task.cancel()
            self.settle(leave)
            assert not self.gates and self.s.in_flight == 0 and self.s.queued == 0
            assert not self.s.flights()  # nothing left behind
        finally:
            self.loop.close()


Flights.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
test_flights_state_machine = Flights.TestCase
