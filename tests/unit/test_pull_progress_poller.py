"""The progress poller against a scripted content API, with a fake clock.

The runtime is a FakeRuntime serving containerd's content API from a small in-memory
store the test changes between polls; the test calls ``tick()`` itself, so every poll
happens at a fake time the test chose. Pulls go through the real PullScheduler.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.config import PullsConfig
from shim.errors import RpcError
from shim.observability.metrics import Metrics
from shim.pulls.poller import ProgressPoller
from shim.pulls.scheduler import PullKey, PullScheduler
from shim.process.status_render import progress_line
from shim.cri.upstream import Upstream
from tests.support.fake_content import SVC, START_WALL, MiB, Store, dg

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Runner:
    """An upstream PullImage held open until the test ends it; records a cancel."""

    def __init__(self) -> None:
        self.gate: asyncio.Future[bytes] | None = None
        self.cancelled = False
        self.calls = 0

    async def __call__(self) -> bytes:
        self.calls += 1
        self.gate = asyncio.get_running_loop().create_future()
        try:
            return await self.gate
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
async def env(runtime):
    store = Store()
    store.serve(runtime)
    upstream = Upstream(runtime.endpoint, 16 << 20)
    clock = Clock()
    metrics = Metrics()
    scheduler = PullScheduler(0, 1, clock=clock)

    def make(**cfg) -> ProgressPoller:
        poller = ProgressPoller(upstream, scheduler, metrics, PullsConfig(**cfg), clock=clock,
                                wall=lambda: START_WALL, autostart=False)
        return poller

    yield store, scheduler, clock, metrics, make
    await upstream.close()


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def test_progress_of_a_pull_and_its_collapsed_callers(env, runtime) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make(progress_log_after_seconds=0)
    m, (l0, l1) = store.add_image("team/app", "a", [4 * MiB, 4 * MiB])
    runner = Runner()
    events: list[list[tuple[str, dict]]] = [[], []]
    key = PullKey("reg.test/team/app:v1")
    waiters = [asyncio.ensure_future(scheduler.pull(key, runner, listener=lambda n, a, i=i: events[i].append((n, a))))
               for i in range(2)]
    await settle()
    flight_id = scheduler.snapshot()["in_flight"][0]["id"]
    assert runner.calls == 1

    assert poller.view(flight_id) == {"phase": "resolving", "reason": "resolving the manifest"}
    await poller.tick()  # finds the manifest (and reads it)
    view = poller.view(flight_id)
    assert view["bytes_total"] == 100 + 8 * MiB and view["layers_total"] == 2
    assert {r.metadata.get("containerd-namespace") for r in runtime.received} == {"k8s.io"}

    for t, (o0, o1) in enumerate([(0, 0), (2 * MiB, 0), (4 * MiB, 1 * MiB)], start=1):
        clock.now = float(t)
        store.write(l0, o0, 4 * MiB)
        if o1:
            store.write(l1, o1, 4 * MiB)
        await poller.tick()
    view = poller.view(flight_id)
    assert view["bytes_done"] == 100 + 5 * MiB and view["bytes_per_second"] == round(5 * MiB / 2)
    assert view["eta_seconds"] == pytest.approx(3 * MiB / (5 * MiB / 2), abs=0.1)
    assert [n for n, _ in events[0]] == [n for n, _ in events[1]] == ["pull 25%", "pull 50%"]
    assert events[0][1][1]["cri_shim.pull.bytes_total"] == 100 + 8 * MiB
    assert sample(metrics, "cri_shim_pull_bytes_total") == 5 * MiB  # config was there when first seen
    assert sample(metrics, "cri_shim_pull_in_flight_bytes", {"kind": "total"}) == 100 + 8 * MiB
    assert "[#####" in progress_line(view) and "5 MiB / 8 MiB" in progress_line(view)

    assert view["phase"] == "downloading"
    clock.now = 4.0
    store.commit(l0, 4 * MiB)
    store.commit(l1, 4 * MiB)
    await poller.tick()
    view = poller.view(flight_id)
    assert view["phase"] == "unpacking" and view["layers_done"] == 2
    assert [n for n, _ in events[0]] == ["pull 25%", "pull 50%", "pull 75%", "pull 100%"]
    assert sample(metrics, "cri_shim_pull_bytes_total") == 8 * MiB

    runner.gate.set_result(b"image")
    assert [o.response for o in await asyncio.gather(*waiters)] == [b"image", b"image"]
    assert poller.view(flight_id) is None and not poller.running


async def test_a_stalled_pull_fails_every_waiter_cancels_upstream_and_aborts_its_ingest(env) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make(stall_timeout_seconds=5, stall_min_bytes_per_second=65536)
    m, (l0,) = store.add_image("team/app", "b", [10 * MiB])
    runner = Runner()
    key = PullKey("reg.test/team/app:v1")
    waiters = [asyncio.ensure_future(scheduler.pull(key, runner)) for _ in range(3)]
    await settle()
    for t in range(0, 40):
        clock.now = float(t)
        store.write(l0, 2000 * t, 10 * MiB)  # 2 KB/s
        await poller.tick()
        await settle()
        if all(w.done() for w in waiters):
            break
    assert clock.now == 17.0  # manifest found at 0, first sample at 1; the window is 16 s (1 MiB at 64 KiB/s)
    errors = [w.exception() for w in waiters]
    assert all(isinstance(e, RpcError) and e.code is grpc.StatusCode.UNAVAILABLE for e in errors)
    assert errors[0].details == ("cri-shim: pull of reg.test/team/app:v1 stalled: 31.2 KiB in the last 16 s "
                                 "(< 64 KiB/s); cancelled")
    assert runner.cancelled
    assert sample(metrics, "cri_shim_pull_stalls_total") == 1
    assert store.ingests  # containerd may keep a cancelled pull's ingest (to resume it later)...
    await poller.tick()
    assert store.aborted == [f"layer-{l0}"] and not store.ingests  # ...the shim aborts it


async def test_no_content_api_means_unknown_progress_and_no_stall_guard(env, runtime) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make(stall_timeout_seconds=5)
    runtime.unary[SVC + "ListStatuses"] = grpc.StatusCode.UNIMPLEMENTED
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("quay.io/org/app:v1"), runner))
    await settle()
    flight_id = scheduler.snapshot()["in_flight"][0]["id"]
    for t in range(0, 100, 10):
        clock.now = float(t)
        await poller.tick()
    await settle()
    assert poller.view(flight_id) == {"phase": "unknown",
                                      "reason": "the runtime has no containerd content API (e.g. CRI-O)"}
    assert len(runtime.calls("ListStatuses")) == 1  # asked once, not on every poll
    assert not waiter.done() and not runner.cancelled
    assert "unknown" in progress_line(poller.view(flight_id))
    runner.gate.set_result(b"ok")
    await waiter


async def test_unpacking_with_no_bytes_moving_is_not_a_stall(env) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make(stall_timeout_seconds=5, stall_min_bytes_per_second=1 << 30)
    m, (l0,) = store.add_image("team/app", "c", [MiB])
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/app:v1"), runner))
    await settle()
    flight_id = scheduler.snapshot()["in_flight"][0]["id"]
    store.write(l0, MiB, MiB)
    await poller.tick()
    store.commit(l0, MiB)
    for t in range(1, 120):
        clock.now = float(t)
        await poller.tick()
    await settle()
    assert poller.view(flight_id)["phase"] == "unpacking"
    assert not waiter.done() and not runner.cancelled
    assert sample(metrics, "cri_shim_pull_stalls_total") == 0
    runner.gate.set_result(b"ok")
    await waiter


async def test_one_poll_costs_a_bounded_number_of_calls_whatever_the_number_of_pulls(env, runtime) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make()
    runners, waiters = [], []
    for i in range(30):
        char = "abcdef0123456789"[i % 16]
        store.add_image(f"team/app{i}", char, [MiB])
        runners.append(Runner())
        waiters.append(asyncio.ensure_future(scheduler.pull(PullKey(f"reg.test/team/app{i}:v1"), runners[-1])))
    await settle()
    for t in range(3):
        before = len(runtime.received)
        clock.now = float(t)
        await poller.tick()
        calls = [r.method.rpartition("/")[2] for r in runtime.received[before:]]
        assert calls.count("ListStatuses") == 1 and calls.count("List") <= 1 and calls.count("Read") <= 2, calls
    for r in runners:
        r.gate.set_result(b"ok")
    await asyncio.gather(*waiters)


async def test_two_tags_of_one_repository_at_once_are_unknown_rather_than_guessed(env) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make()
    store.add_image("team/app", "a", [MiB])
    store.add_image("team/app", "b", [MiB])
    runners = [Runner(), Runner()]
    waiters = [asyncio.ensure_future(scheduler.pull(PullKey(f"reg.test/team/app:v{i}"), runners[i])) for i in (0, 1)]
    await settle()
    ids = [row["id"] for row in scheduler.snapshot()["in_flight"]]
    await poller.tick()
    for i in ids:
        assert poller.view(i) == {"phase": "resolving", "reason": "other tags of this repository are being pulled"}
    for r in runners:
        r.gate.set_result(b"ok")
    await asyncio.gather(*waiters)


async def test_a_pull_that_ends_between_two_polls_still_counts_all_its_bytes_and_reaches_100(env) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make()
    m, (l0,) = store.add_image("team/app", "d", [4 * MiB])
    runner = Runner()
    events: list[str] = []
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/app:v1"), runner,
                                                  listener=lambda n, a: events.append(n)))
    await settle()
    await poller.tick()  # the manifest
    store.write(l0, MiB, 4 * MiB)
    clock.now = 1.0
    await poller.tick()
    assert events == ["pull 25%"] and sample(metrics, "cri_shim_pull_bytes_total") == MiB
    runner.gate.set_result(b"ok")  # the rest arrived and the runtime answered before the next poll
    await waiter
    assert events == ["pull 25%", "pull 50%", "pull 75%", "pull 100%"]
    assert sample(metrics, "cri_shim_pull_bytes_total") == 4 * MiB


async def test_blobs_committed_since_the_pull_started_count_as_downloaded_older_ones_do_not(env) -> None:
    store, scheduler, clock, metrics, make = env
    poller = make()
    m, (l0, l1) = store.add_image("team/app", "e", [3 * MiB, 5 * MiB])
    store.blobs[l0] = (3 * MiB, {}, START_WALL - 60, b"")  # a base layer another image brought earlier
    store.commit(l1, 5 * MiB)  # downloaded by this pull between two polls (committed at START_WALL + 2)
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/app:v1"), runner))
    await settle()
    flight_id = scheduler.snapshot()["in_flight"][0]["id"]
    await poller.tick()
    clock.now = 1.0
    await poller.tick()
    assert poller.view(flight_id)["bytes_done"] == 100 + 8 * MiB
    assert sample(metrics, "cri_shim_pull_bytes_total") == 5 * MiB
    runner.gate.set_result(b"ok")
    await waiter
    assert sample(metrics, "cri_shim_pull_bytes_total") == 5 * MiB


# ---------------------------------------------------------------- the no-progress guard


async def run_ticks(poller, clock, times, between=None) -> None:
    for t in times:
        clock.now = float(t)
        if between is not None:
            between(t)
        await poller.tick()
        await settle()


async def test_a_pull_hung_resolving_is_ended_for_every_waiter_and_frees_its_slot(env) -> None:
    """The registry never answers the manifest: nothing of the repository appears. After
    no_progress_timeout_seconds every caller of that pull gets UNAVAILABLE naming the
    phase and registry, its upstream call is cancelled, and the queued pull starts."""
    store, scheduler, clock, metrics, make = env
    scheduler.configure(1, 1, True)
    poller = make(no_progress_timeout_seconds=60)
    hung, healthy = Runner(), Runner()
    waiters = [asyncio.ensure_future(scheduler.pull(PullKey("reg.test:5000/team/hung:v1"), hung)) for _ in range(2)]
    queued = asyncio.ensure_future(scheduler.pull(PullKey("reg.test:5000/team/ok:v1"), healthy))
    await settle()
    await run_ticks(poller, clock, range(0, 60))
    assert not any(w.done() for w in waiters) and healthy.calls == 0
    await run_ticks(poller, clock, [60])
    errors = [w.exception() for w in waiters]
    assert all(isinstance(e, RpcError) and e.code is grpc.StatusCode.UNAVAILABLE for e in errors)
    assert errors[0].details == (
        "cri-shim: pull of reg.test:5000/team/hung:v1 made no progress for 60 s (resolving the manifest from "
        "reg.test:5000: no manifest, no bytes); cancelled so that it does not hold a pull slot "
        "(pulls.no_progress_timeout_seconds), retry later")
    assert hung.cancelled and healthy.calls == 1
    assert sample(metrics, "cri_shim_pull_no_progress_total", {"phase": "resolving"}) == 1
    healthy.gate.set_result(b"ok")
    assert (await queued).response == b"ok"


async def test_a_resolving_pull_is_not_ended_while_an_unowned_download_moves(env) -> None:
    """Before its manifest is known, bytes the runtime writes that no known pull owns may be
    this pull's (e.g. its manifest or index being fetched): that counts as progress."""
    store, scheduler, clock, metrics, make = env
    poller = make(no_progress_timeout_seconds=20)
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/idx:v1"), runner))
    await settle()
    await run_ticks(poller, clock, range(0, 100, 5), lambda t: store.write(dg("d"), t * 1000, 10 ** 6))
    assert not waiter.done()
    await run_ticks(poller, clock, range(100, 125, 5))  # the ingest stops moving
    assert isinstance(waiter.exception(), RpcError) and runner.cancelled
    assert "(resolving the manifest from reg.test: no manifest, no bytes)" in waiter.exception().details


async def test_a_slow_download_in_1_mib_steps_is_not_ended_a_stopped_one_is(env) -> None:
    """100 KB/s: containerd moves the ingest's offset 1 MiB every ~10.5 s. A 15 s timeout
    leaves it alone; once the bytes stop, the pull is ended 15 s after the last step."""
    store, scheduler, clock, metrics, make = env
    poller = make(no_progress_timeout_seconds=15)
    m, (l0,) = store.add_image("team/app", "a", [8 * MiB])
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/app:v1"), runner))
    await settle()

    def trickle(t: float) -> None:
        store.write(l0, min(t * 100_000, 5 * MiB) // MiB * MiB, 8 * MiB)

    await run_ticks(poller, clock, range(0, 60), trickle)
    assert not waiter.done()
    last_step = 5 * MiB / 100_000  # 52.4 s: the offset reaches 5 MiB and stays there
    await run_ticks(poller, clock, range(60, 68), trickle)
    assert not waiter.done() and clock.now < last_step + 15
    await run_ticks(poller, clock, range(68, 70), trickle)
    error = waiter.exception()
    assert isinstance(error, RpcError) and error.code is grpc.StatusCode.UNAVAILABLE
    assert "made no progress for 15 s (downloading: 5 MiB of 8 MiB, no more bytes from reg.test)" in error.details
    assert sample(metrics, "cri_shim_pull_no_progress_total", {"phase": "downloading"}) == 1
    await poller.tick()
    assert store.aborted == [f"layer-{l0}"]  # its leftover ingest is aborted, as after a stall


async def test_no_progress_guard_is_on_by_default_and_off_at_0(env) -> None:
    store, scheduler, clock, metrics, make = env
    assert PullsConfig().no_progress_timeout_seconds == 60
    poller = make(no_progress_timeout_seconds=0)
    runner = Runner()
    waiter = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/hung:v1"), runner))
    await settle()
    await run_ticks(poller, clock, range(0, 600, 10))
    assert not waiter.done()
    runner.gate.set_result(b"ok")
    await waiter


async def test_a_pull_with_nothing_open_waits_while_other_downloads_move_an_open_stuck_one_does_not(env) -> None:
    """containerd 2.x's transfer service downloads a few blobs node-wide: a pull may wait with
    nothing of its own open while others download. It is ended only once the node is idle.
    A pull whose own download is open and stuck is ended even while others move."""
    store, scheduler, clock, metrics, make = env
    poller = make(no_progress_timeout_seconds=20)
    busy, (lb,) = store.add_image("team/busy", "b", [64 * MiB])
    stuck, (ls,) = store.add_image("team/stuck", "c", [8 * MiB])
    runners = {name: Runner() for name in ("waiting", "busy", "stuck")}
    waiting = asyncio.ensure_future(scheduler.pull(PullKey("reg.test/team/waiting:v1"), runners["waiting"]))
    others = [asyncio.ensure_future(scheduler.pull(PullKey(f"reg.test/team/{n}:v1"), runners[n])) for n in ("busy", "stuck")]
    await settle()

    def move(t: float) -> None:
        store.write(lb, min(int(t), 60) * MiB, 64 * MiB)  # moves until t=60
        store.write(ls, MiB, 8 * MiB)  # open, never moves

    await run_ticks(poller, clock, range(0, 60), move)
    assert others[1].done() and "(downloading: 1 MiB of 8 MiB" in others[1].exception().details
    assert not waiting.done() and not others[0].done()
    await run_ticks(poller, clock, range(60, 79), move)
    assert not waiting.done()
    await run_ticks(poller, clock, range(79, 82), move)
    assert waiting.done() and "(resolving the manifest" in waiting.exception().details
    assert others[0].done() and "(downloading: 60 MiB of 64 MiB" in others[0].exception().details
