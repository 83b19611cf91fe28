"""Pull slots between peers (shim/pulls/slots.py), deterministically: untrusted uids within
their share and their own part of it, released pulls still counted, the hard bound, and the
class of a collapsed flight (the priority rule of scheduler.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.cri.deadline import Deadline
from shim.errors import RpcError
from shim.pulls.scheduler import PullScheduler
from shim.pulls.slots import Priority, Slots
from tests.unit.test_scheduler import Upstream, key, settle

U = Priority.UNTRUSTED


def pull(s: PullScheduler, up: Upstream, image: str, uid: int | None = None, **kw):
    """A pull by root (uid None) or by an untrusted ``uid``."""
    priority = Priority.FOREGROUND if uid is None else U
    return asyncio.create_task(s.pull(key(image), up.runner(image), priority=priority, uid=uid, **kw))


@pytest.mark.parametrize(("cap", "share", "per_uid", "untrusted", "mine", "bound"), [
    (4, 0.5, 1, 2, 1, 8),
    (4, 1.0, 4, 3, 3, 8),  # never the last slot
    (3, 0.5, 1, 1, 1, 6),  # at least one
    (2, 0.1, 1, 1, 1, 4),
    (1, 0.5, 1, 0, 0, 2),  # no slot for untrusted peers
    (16, 0.25, 2, 4, 2, 32),
    (0, 0.5, 3, None, 3, 0),  # no cap: no share, no bound; a uid still its own limit
])
def test_slot_arithmetic(cap: int, share: float, per_uid: int, untrusted: int | None, mine: int, bound: int) -> None:
    slots = Slots(cap, 1, share, per_uid)
    assert (slots.untrusted_slots, slots.per_uid_slots, slots.hard_bound) == (untrusted, mine, bound)


async def test_an_untrusted_uid_filling_every_slot_it_may_leaves_root_a_slot() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)  # share 0.5: 2 slots, 1 per uid
    mine = [pull(s, up, f"u{i}", uid=1000) for i in range(40)]
    theirs = [pull(s, up, f"v{i}", uid=1001) for i in range(3)]
    third = pull(s, up, "w0", uid=1002)
    await settle()
    assert up.calls == ["u0", "v0"]  # one each; the share is full, uid 1002 waits
    assert s.running.describe()["untrusted_by_uid"] == {"1000": 1, "1001": 1}
    roots = [pull(s, up, f"root{i}") for i in range(3)]
    await settle()
    assert up.calls[2:] == ["root0", "root1"]  # the rest of the cap is trusted pulls'
    up.release("root0")
    await settle()
    assert up.calls[4:] == ["root2"]  # a trusted pull goes before the 42 untrusted ones queued
    up.release("u0")
    await settle()
    assert up.calls[5:] == ["w0"]  # uid 1002's, queued after uid 1000's next: uid 1000 holds its part
    up.release("w0")
    await settle()
    assert up.calls[6:] == ["u1"]
    for t in (*mine, *theirs, third, *roots):
        t.cancel()
    await asyncio.gather(*mine, *theirs, third, *roots, return_exceptions=True)


async def test_released_untrusted_pulls_still_hold_their_share() -> None:
    """The lease regime: untrusted pulls whose progress nobody judges are released one after
    the other; no more of them start, and the runtime sees their share and no more."""
    up, s = Upstream(), PullScheduler(max_parallel=4, max_parallel_per_uid=2)
    hung = [pull(s, up, f"h{i}", uid=1000) for i in range(40)]
    await settle()
    for _ in range(5):
        for f in list(s.holding):
            s.release(f, "progress not judged")
        await settle()
    assert up.calls == ["h0", "h1"] and s.in_flight == 2 and s.holding == []
    root = pull(s, up, "root")
    await settle()
    assert up.calls[-1] == "root"
    up.release("root")
    await root
    for t in hung:
        t.cancel()
    await asyncio.gather(*hung, return_exceptions=True)


async def test_released_trusted_pulls_stop_at_twice_the_cap() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=2)
    hung = [pull(s, up, f"h{i}") for i in range(10)]
    for _ in range(5):
        await settle()
        for f in list(s.holding):
            s.release(f, "progress not judged")
    await settle()
    assert up.calls == ["h0", "h1", "h2", "h3"] and up.active == 4 == s.slots.hard_bound
    assert s.queued == 6  # at the bound nothing starts, with a slot free or not
    up.release("h0")
    await settle()
    assert up.calls[4:] == ["h4"] and up.active == 4
    for t in hung:
        t.cancel()
    await asyncio.gather(*hung, return_exceptions=True)


async def test_prefetch_and_untrusted_peers_together_never_hold_the_last_slot() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4, background_max_parallel=2, max_parallel_per_uid=2)
    bg = [asyncio.create_task(s.pull(key(f"b{i}"), up.runner(f"b{i}"), priority=Priority.BACKGROUND))
          for i in range(3)]
    await settle()
    untrusted = [pull(s, up, f"u{i}", uid=1000) for i in range(3)]
    await settle()
    assert sorted(up.calls) == ["b0", "b1", "u0"]  # 3 = max_parallel - 1
    s.release(next(f for f in s.holding if f.key.image == "b0"), "progress not judged")
    await settle()
    assert len(up.calls) == 3  # a released background pull still counts against prefetch
    root = pull(s, up, "root")
    await settle()
    assert up.calls[-1] == "root"
    for t in (*bg, *untrusted, root):
        t.cancel()
    await asyncio.gather(*bg, *untrusted, root, return_exceptions=True)


async def test_root_pulling_what_an_untrusted_uid_queued_starts_its_own_pull_at_once() -> None:
    """Root never joins an untrusted uid's flight (its request, its lane): its own starts on a
    trusted slot, and the uid's stays queued behind the uid's own pull."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    busy = [pull(s, up, "u0", uid=1000), pull(s, up, "v0", uid=1001)]
    queued = asyncio.create_task(s.pull(key("shared"), up.runner("theirs"), priority=U, uid=1000))
    await settle()
    assert up.calls == ["u0", "v0"]
    root = asyncio.create_task(s.pull(key("shared"), up.runner("root's")))
    await settle()
    assert up.calls == ["u0", "v0", "root's"]
    assert [(r["priority"], r.get("uid")) for r in s.snapshot()["queued"]] == [("untrusted", 1000)]
    up.release("root's", b"x")
    out = await root
    assert out.response == b"x" and not out.joined
    up.release("u0")
    await settle()
    assert up.calls[-1] == "theirs"  # its own turn, in its own lane
    up.release("theirs", b"y")
    assert (await queued).response == b"y"
    busy[1].cancel()
    await asyncio.gather(*busy, return_exceptions=True)


async def test_root_pulling_what_an_untrusted_uid_runs_starts_its_own_and_leaves_the_uid_its_part() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    first = asyncio.create_task(s.pull(key("u0"), up.runner("theirs"), priority=U, uid=1000))
    second = pull(s, up, "u1", uid=1000)
    await settle()
    assert up.calls == ["theirs"]
    root = asyncio.create_task(s.pull(key("u0"), up.runner("root's")))
    await settle()
    assert up.calls == ["theirs", "root's"]  # root's own request went upstream
    assert s.running.describe()["untrusted_by_uid"] == {"1000": 1}  # the uid's pull still counts as its own
    up.release("root's")
    up.release("theirs")
    await settle()
    assert up.calls[-1] == "u1"
    up.release("u1")
    await asyncio.gather(first, second, root)


async def test_a_queued_flight_goes_to_its_uid_when_root_leaves_it() -> None:
    """An untrusted uid joins root's queued pull; root leaves (its deadline): the flight's only
    caller is untrusted, so it waits in that uid's lane and does not take the trusted slot."""
    up, s = Upstream(), PullScheduler(max_parallel=2)  # 1 trusted slot, 1 untrusted
    root_busy = pull(s, up, "r0")
    mine = pull(s, up, "u0", uid=1000)
    await settle()
    root = pull(s, up, "u1", deadline=Deadline.after(0.05))  # the trusted slot is taken: queued as trusted
    await settle()
    queued = pull(s, up, "u1", uid=1000)  # joins root's
    await settle()
    assert [r["priority"] for r in s.snapshot()["queued"]] == ["foreground"]
    with pytest.raises(RpcError) as e:
        await root
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    row = s.snapshot()["queued"][0]
    assert (row["priority"], row["uid"]) == ("untrusted", 1000)  # its only caller is untrusted now
    up.release("r0")
    await settle()
    assert up.calls == ["r0", "u0"]  # it does not take the trusted slot
    up.release("u0")
    await settle()
    assert up.calls[-1] == "u1"
    up.release("u1")
    assert (await queued).joined
    await asyncio.gather(root_busy, mine)


async def test_a_queued_flight_prefetch_waits_for_never_goes_to_an_untrusted_lane() -> None:
    """Root's queued pull, joined by uid 1000 and by prefetch; root leaves. The flight waits as
    prefetch's, not in uid 1000's lane behind the uid's own slow pull: it starts at the next
    free slot while that pull still runs."""
    up, s = Upstream(), PullScheduler(max_parallel=4)
    roots = [pull(s, up, f"r{i}") for i in range(3)]
    slow = pull(s, up, "slow", uid=1000)  # the uid's part (1) is taken until it ends
    await settle()
    assert len(up.calls) == 4
    root = pull(s, up, "x", deadline=Deadline.after(0.05))  # every slot held: queued as trusted
    await settle()
    theirs = pull(s, up, "x", uid=1000)
    prefetch = asyncio.create_task(s.pull(key("x"), up.runner("x-prefetch"), priority=Priority.BACKGROUND))
    await settle()
    with pytest.raises(RpcError):
        await root
    assert [(r["priority"], r.get("uid")) for r in s.snapshot()["queued"]] == [("background", None)]
    up.release("r0")
    await settle()
    assert up.calls[-1] == "x" and not slow.done()
    up.release("x", b"id")
    assert (await prefetch).joined and (await theirs).response == b"id"
    up.release("r1")
    up.release("r2")
    up.release("slow")
    await asyncio.gather(*roots, slow)


async def test_with_a_cap_of_one_untrusted_pulls_are_refused_but_may_join_roots() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=1)
    with pytest.raises(RpcError) as e:
        await s.pull(key("x"), up.runner("x"), priority=U, uid=1000)
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "server.trusted_uids" in e.value.details
    root = pull(s, up, "y")
    await settle()
    joined = pull(s, up, "y", uid=1000)
    await settle()
    up.release("y", b"y")
    assert (await joined).joined and (await root).response == b"y"


async def test_lowering_the_cap_to_one_refuses_queued_untrusted_pulls() -> None:
    up, s = Upstream(), PullScheduler(max_parallel=4)
    running = pull(s, up, "u0", uid=1000)
    queued = pull(s, up, "u1", uid=1000)
    await settle()
    s.configure(1, 1, True)
    with pytest.raises(RpcError) as e:
        await queued
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    up.release("u0")
    await running  # a running one finishes


async def test_with_a_cap_of_one_a_queued_flight_left_to_untrusted_callers_is_refused() -> None:
    """Joining root's queued flight is allowed; when root stops waiting for it, the flight's only
    callers are untrusted, and with a cap of 1 no slot is theirs: refused (README Limits), not
    queued where nothing can ever start it (an untrusted caller without a deadline hung forever)."""
    up, s = Upstream(), PullScheduler(max_parallel=1)
    busy = pull(s, up, "r0")
    await settle()
    root = pull(s, up, "y", deadline=Deadline.after(0.05))  # queued behind r0 as trusted
    joined = pull(s, up, "y", uid=1000)  # no deadline, like kubelet's PullImage
    await settle()
    with pytest.raises(RpcError) as e:
        await root
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(RpcError) as e:
        await asyncio.wait_for(joined, 1.0)
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "server.trusted_uids" in e.value.details
    assert s.queued == 0
    up.release("r0")
    await busy
    assert up.calls == ["r0"]
