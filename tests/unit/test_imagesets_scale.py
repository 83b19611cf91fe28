"""Image sets at scale, without timing anything: the due-time queue, the retry budget per
registry host, the counts kept as images change state (and as sets change), and
image_sets.max_images refusing a set instead of growing the process."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from shim.config import ImageSetsConfig
from shim.credentials import DockerConfigFiles
from shim.credentials.prefetch import PrefetchCredentials
from shim.imagesets.due import FORGET_SECONDS, DueQueue, RetryBudget
from shim.imagesets.loader import ImageSet
from shim.imagesets.prefetch import Prefetch
from shim.imagesets.reconciler import Reconciler
from shim.imagesets.runtime_view import RuntimeNames
from shim.imagesets.table import diff_versions
from shim.observability.metrics import Metrics
from shim.proto.runtime.v1 import api_pb2
from shim.pulls.scheduler import PullScheduler
from tests.support.prefetch_store import SERVICE, FakeImages
from tests.unit.test_imagesets import image_sets, own, reconciled, write
from tests.support.wait import wait_for


# ------------------------------------------------------------------ the due-time queue

def test_due_queue_yields_what_fell_due_in_order_and_skips_dead_entries() -> None:
    q: DueQueue[str] = DueQueue()
    for at, item in [(5.0, "e"), (1.0, "a"), (3.0, "c"), (2.0, "b"), (4.0, "d")]:
        q.push(at, item)
    dead = {"b"}

    def alive(at: float, item: str) -> bool:
        return item not in dead
    assert q.next_at(alive) == 1.0
    assert list(q.pop_due(3.0, alive)) == ["a", "c"]  # b was dropped meanwhile
    assert q.next_at(alive) == 4.0
    dead.add("d")
    assert q.next_at(alive) == 5.0  # a dead top entry is not a reason to wake
    assert list(q.pop_due(10.0, alive)) == ["e"] and len(q) == 0 and q.next_at(alive) is None


def test_due_queue_rescheduled_item_counts_once() -> None:
    """An item pushed again with a new time: the old entry is dead (its time no longer matches)."""
    q: DueQueue[str] = DueQueue()
    due = {"x": 10.0}
    q.push(10.0, "x")
    due["x"] = 2.0
    q.push(2.0, "x")

    def alive(at: float, item: str) -> bool:
        return due[item] == at
    assert list(q.pop_due(20.0, alive)) == ["x"]


# ------------------------------------------------------------------ the retry budget

def test_retry_budget_limits_each_registry_host_on_its_own() -> None:
    b: RetryBudget[str] = RetryBudget(per_second=2.0)
    assert [b.admit("a.io", f"a{i}", 0.0) for i in range(4)] == [True, True, False, False]  # burst of 2
    assert b.admit("b.io", "b0", 0.0) is True  # another registry is not held back by a.io
    assert b.waiting() == {"a.io": 2}
    assert b.next_at() == 0.5
    assert b.release(0.4) == []
    assert b.release(0.5) == ["a2"]  # one token earned, oldest first
    assert b.admit("a.io", "a4", 0.5) is False  # behind the ones already waiting
    assert b.release(1.5) == ["a3", "a4"]
    assert b.waiting() == {} and b.next_at() is None


def test_retry_budget_zero_is_no_limit() -> None:
    b: RetryBudget[int] = RetryBudget(per_second=0.0)
    assert all(b.admit("a.io", i, 0.0) for i in range(1000))


def test_retry_budget_slows_a_failing_host_to_a_tenth_and_speeds_up_as_it_heals() -> None:
    b: RetryBudget[str] = RetryBudget(per_second=4.0)
    for i in range(10):
        b.failed("down.io", float(i))
    assert b.slowed() == {"down.io": 0.4}  # halved per failure, never below a tenth
    assert b.admit("down.io", "d0", 10.0) is True  # the one token it holds
    assert b.admit("down.io", "d1", 10.0) is False
    assert b.next_at() == 12.5  # one token every 2.5 s, not every 0.25 s
    assert b.admit("up.io", "u0", 10.0) and b.slowed() == {"down.io": 0.4}  # another host keeps its rate
    b.succeeded("down.io", 10.0)
    b.succeeded("down.io", 10.0)
    b.succeeded("down.io", 10.0)
    assert b.slowed() == {"down.io": 3.2}
    b.succeeded("down.io", 10.0)  # the fourth success
    assert b.slowed() == {} and b.next_at() == 10.25  # full rate again
    assert b.release(10.25) == ["d1"]


def test_retry_budget_forgets_a_slowed_host_only_after_it_was_idle_long() -> None:
    b: RetryBudget[str] = RetryBudget(per_second=2.0)
    b.failed("down.io", 0.0)
    assert b.release(60.0) == [] and b.slowed() == {"down.io": 1.0}  # idle, but slowed recently: kept
    b.release(FORGET_SECONDS + 1.0)
    assert b.slowed() == {}
    assert [b.admit("down.io", f"x{i}", FORGET_SECONDS + 1.0) for i in range(3)] == [True, True, False]


def test_retry_budget_reload_keeps_a_slowed_hosts_share_and_no_limit_frees_the_waiting() -> None:
    b: RetryBudget[str] = RetryBudget(per_second=4.0)
    b.failed("down.io", 0.0)
    b.configure(8.0)
    assert b.slowed() == {"down.io": 4.0}  # half of the new rate
    assert [b.admit("down.io", x, 0.0) for x in "abw"] == [True, True, False]  # its burst was halved to 2
    b.configure(0.0)
    assert b.next_at() == 0.0 and b.release(0.0) == ["w"] and b.waiting() == {} and b.next_at() is None


async def test_failed_images_of_one_registry_wait_for_its_budget_not_the_others(runtime, tmp_path) -> None:
    store = FakeImages(runtime).install()
    slow = [f"slow.local/app{i}:1" for i in range(5)]
    for r in slow:
        store.fail(r, 1000)
    store.fail("fast.local/app:1", 1)
    (tmp_path / "a.yaml").write_text(own("warm", slow + ["fast.local/app:1"]))
    async with image_sets(runtime, tmp_path, max_parallel=2, retry_initial_seconds=0.01, retry_max_seconds=0.02,
                          retry_per_second=0.001) as h:  # a burst of one retry, then one every 1,000 s
        await reconciled(h, "warm", 1)  # fast.local's retry was not held back by slow.local's
        # 4 wait while the one retry with the token runs, 5 once it failed again (a busy machine may poll late)
        await wait_for(lambda: h.status()["retry_budget"]["waiting"].get("slow.local", 0) >= 4,
                         what="slow.local's other retries to wait for a token")
        assert sum(store.pulls.count(r) for r in slow) == 5 + 1  # first attempts, then one retry
        s = h.set_status("warm")
        assert s["failed"] == 5 and s["failed_reasons"] == {"notFound": 5}
        # slow.local failed every pull: slowed; fast.local failed once, then succeeded: full rate
        assert list(h.status()["retry_budget"]["slowed"]) == ["slow.local"]


# ------------------------------------------------------------------ counts kept as they change

def _reconciler(**cfg: object) -> tuple[Reconciler, None]:
    config = ImageSetsConfig(docker_config=(), **cfg)  # type: ignore[arg-type]
    metrics = Metrics()
    prefetch = Prefetch(config, None, PullScheduler(4, 2, observers=[metrics]),  # type: ignore[arg-type]
                        PrefetchCredentials(DockerConfigFiles(())), metrics)
    rec = Reconciler(config, None, prefetch, metrics)  # type: ignore[arg-type]
    return rec, None


def _set(name: str, refs: list[str], generation: str = "1", pin: bool = False) -> ImageSet:
    return ImageSet(name=name, kind="ImageSet", pin=pin, refs=tuple(refs), spelled=tuple(refs),
                    generation=generation, source=f"/sets/{name}.yaml")


def test_counts_follow_set_edits_and_shared_images_count_once_in_total() -> None:
    rec, _ = _reconciler()
    a, b = _set("a", ["r/x:1", "r/y:1", "r/z:1"]), _set("b", ["r/y:1", "r/w:1"])
    rec.set_sets({"a": a, "b": b})
    snap = rec.snapshot()
    assert snap.sets["a"].counts.declared == 3 and snap.sets["a"].counts.unknown == 3
    assert snap.sets["b"].counts.unknown == 2 and snap.totals.declared == 4  # r/y:1 once
    rec.set_sets({"a": _set("a", ["r/x:1", "r/v:1"], "2"), "b": b})  # z dropped, v added
    snap = rec.snapshot()
    assert snap.sets["a"].counts.declared == 2 and snap.sets["a"].counts.unknown == 2
    assert snap.totals.declared == 4  # x, v, y, w
    rec.set_sets({"a": _set("a", ["r/x:1", "r/v:1"], "2")})
    snap = rec.snapshot()
    assert list(snap.sets) == ["a"] and snap.totals.declared == 2 and snap.totals.unknown == 2


def test_an_edit_of_a_large_set_applies_exactly_what_changed() -> None:
    """Order swapped, one name dropped, names added at the front and in the middle, a handler
    declared on one: the counts follow, shared images stay, and the added ones come in file order."""
    rec, _ = _reconciler()
    names = [f"r/i{i}:1" for i in range(10_000)]
    rec.set_sets({"a": _set("a", names), "b": _set("b", ["r/i5:1", "r/other:1"])})
    edited = names[:]
    edited[1], edited[-2] = edited[-2], edited[1]
    del edited[5]  # r/i5:1 stays declared by b
    edited.insert(0, "r/first:1")
    edited.insert(5000, "r/middle:1")
    rec.set_sets({"a": _set("a", edited, "2"), "b": _set("b", ["r/i5:1", "r/other:1"])})
    snap = rec.snapshot()
    assert snap.sets["a"].counts.declared == 10_001 and snap.sets["a"].counts.unknown == 10_001
    assert snap.totals.declared == 10_003  # 10,001 of a, r/i5:1 and r/other:1 of b
    gone, added = diff_versions(_set("a", names), _set("a", edited))
    assert gone == [("r/i5:1", "")] and added == [(("r/first:1", ""), "r/first:1"), (("r/middle:1", ""), "r/middle:1")]
    many = [f"r/new{i}:1" for i in range(100)]  # above EDIT_SCAN_MIN: one pass finds their places
    gone, added = diff_versions(_set("a", names), _set("a", many[:50] + names[1:] + many[50:]))
    assert gone == [("r/i0:1", "")] and [spelled for _, spelled in added] == many
    with_handler = ImageSet(name="a", kind="ImageSet", pin=False, refs=tuple(names), spelled=tuple(names),
                            generation="3", source="/sets/a.yaml", handlers=("kata",) + ("",) * 9_999)
    gone, added = diff_versions(_set("a", names), with_handler)
    assert gone == [("r/i0:1", "")] and added == [(("r/i0:1", "kata"), "r/i0:1")]
    rec.set_sets({"a": with_handler})
    snap = rec.snapshot()
    assert snap.sets["a"].counts.declared == 10_000 and list(snap.sets) == ["a"] and snap.totals.declared == 10_000


def test_an_unchanged_set_is_not_diffed_again(caplog) -> None:
    rec, _ = _reconciler()
    a = _set("a", [f"r/i{i}:1" for i in range(100)])
    caplog.set_level(logging.INFO, logger="cri_shim")
    rec.set_sets({"a": a})
    rec.set_sets({"a": _set("a", [f"r/i{i}:1" for i in range(100)]), "b": _set("b", ["r/j:1"])})
    loaded = [r.fields["set"] for r in caplog.records if r.getMessage() == "image set loaded"]  # type: ignore[attr-defined]
    assert loaded == ["a", "b"]  # the equal copy of a cost nothing (not loaded again)


async def test_counts_match_the_images_as_pulls_finish_and_fail(runtime, tmp_path) -> None:
    store = FakeImages(runtime).install()
    store.add("registry.local/here:1")
    store.fail("registry.local/gone:1", 1000)
    f = tmp_path / "a.yaml"
    f.write_text(own("warm", ["registry.local/here:1", "registry.local/new:1", "registry.local/gone:1"]))
    async with image_sets(runtime, tmp_path, retry_initial_seconds=0.05, retry_max_seconds=0.05) as h:
        await wait_for(lambda: "warm" in h.status()["sets"] and h.set_status("warm")["present"] == 2 and h.set_status("warm")["failed"] == 1,
                         what="two present, one failed")
        write(f, own("warm", ["registry.local/here:1", "registry.local/other:1"]))  # gone dropped, other added
        await wait_for(lambda: h.set_status("warm")["declared"] == 2, what="the edit to apply")
        s = await reconciled(h, "warm", 2)
        assert (s["declared"], s["failed"], s["queued"], s["pulling"]) == (2, 0, 0, 0)
        assert s["last_error"] == "" and "failed_reasons" not in s
        images = h.status()["images"]
        assert images == {"present": 2, "pulling": 0, "queued": 0, "failed": 0, "unknown": 0}
        assert h.gauge("warm", "failed") == 0 and h.gauge("warm", "present") == 2


# ------------------------------------------------------------------ image_sets.max_images

def test_a_set_beyond_max_images_is_refused_and_its_previous_version_stays(caplog) -> None:
    rec, _ = _reconciler(max_images=5)
    caplog.set_level(logging.ERROR, logger="cri_shim")
    rec.set_sets({"a": _set("a", ["r/a:1", "r/b:1"]), "b": _set("b", ["r/c:1", "r/d:1"])})
    rec.set_sets({"a": _set("a", ["r/a:1", "r/b:1", "r/e:1", "r/f:1"], "2"), "b": _set("b", ["r/c:1", "r/d:1"])})
    snap = rec.snapshot()
    assert snap.sets["a"].generation == "1" and snap.sets["a"].counts.declared == 2  # last valid version kept
    why = snap.refused["a"]
    assert "above image_sets.max_images 5" in why and "generation 1 stays in force" in why
    assert "too many images declared" in caplog.text
    assert rec.status()["sets"]["a"]["refused"] == why
    rec.set_sets({"c": _set("c", [f"r/c{i}:1" for i in range(9)])})  # a and b removed: room for... not 9
    snap = rec.snapshot()
    assert list(snap.sets) == [] and "not applied" in snap.refused["c"]
    rec.set_sets({"c": _set("c", [f"r/c{i}:1" for i in range(5)])})  # fits now
    snap = rec.snapshot()
    assert snap.refused == {} and snap.sets["c"].counts.declared == 5


def test_max_images_is_a_documented_config_key(tmp_path: Path) -> None:
    from shim.config import ConfigError, from_dict
    assert from_dict({"image_sets": {"max_images": 1000}}).image_sets.max_images == 1000
    for bad in (0, "many"):
        try:
            from_dict({"image_sets": {"max_images": bad}})
        except ConfigError as e:
            assert "image_sets.max_images" in str(e)
        else:
            raise AssertionError(f"max_images={bad!r} accepted")
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "image_sets.max_images" in readme and "image_sets.retry_per_second" in readme


async def test_node_status_reads_the_snapshot_rows_reasons_and_refusals(runtime, tmp_path) -> None:
    from types import SimpleNamespace

    from shim.cluster.node_report import NodeReport
    store = FakeImages(runtime).install()
    store.fail("registry.local/gone:1", 1000)
    (tmp_path / "a.yaml").write_text(own("warm", ["registry.local/ok:1", "registry.local/gone:1"]))
    (tmp_path / "b.yaml").write_text(own("huge", [f"registry.local/h{i}:1" for i in range(4)]))
    async with image_sets(runtime, tmp_path, max_images=3, retry_initial_seconds=5.0) as h:
        await wait_for(lambda: "warm" in h.status()["sets"] and h.set_status("warm")["failed"] == 1,
                         what="one failed image")
        source = SimpleNamespace(node_name="n1", refused={}, last_refused={}, held={}, secret_errors=dict, informers={})
        node = NodeReport(source, h.sets, None,  # type: ignore[arg-type]
                          interval=1.0, event_interval=1.0, event_namespace="default", request_timeout=1.0)
        status = node.document()["status"]
        [row] = status["sets"]
        assert row["name"] == "warm" and row["images"] == {"declared": 2, "present": 1, "pulling": 0, "queued": 0,
                                                           "failed": 1}
        assert row["failedReasons"] == {"notFound": 1} and "registry.local/gone:1" in row["error"]
        assert status["summary"]["declared"] == 2 and status["summary"]["failed"] == 1
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "huge" in degraded["message"] and "max_images 3" in degraded["message"]


def test_runtime_names_are_normalized_once_and_follow_the_runtimes_changes() -> None:
    names_of = RuntimeNames()

    def listed(*images: tuple[list[str], list[str]]) -> bytes:
        r = api_pb2.ListImagesResponse()
        for tags, digests in images:
            r.images.add(id="sha256:" + "a" * 64, repo_tags=tags, repo_digests=digests)
        return r.SerializeToString()
    d = "sha256:" + "b" * 64
    first = listed((["busybox:1", "docker.io/library/busybox:1"], [f"busybox@{d}"]), (["Not A Name"], []))
    names, count = names_of.read(first)
    assert count == 2 and names == {"docker.io/library/busybox:1", f"docker.io/library/busybox@{d}", "Not A Name"}
    assert names_of.read(first)[0] == names  # unchanged: served from the names' normal forms kept
    names, count = names_of.read(listed((["quay.io/x/y:2"], [])))
    assert count == 1 and names == {"quay.io/x/y:2"} and names_of.kept() == ["quay.io/x/y:2"]


async def test_images_declared_while_the_full_pass_is_on_its_way_do_not_wait_for_it(runtime, tmp_path) -> None:
    """The periodic ListImages of a large runtime takes a while: a set edited meanwhile is
    looked up and pulled at once, and the list's older answer does not undo what was learnt."""
    store = FakeImages(runtime, list_as_asked=True).install()
    store.add("reg.local/old:1")
    (tmp_path / "a.yaml").write_text(own("big", ["reg.local/old:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "big", 1)
        store.list_gate = asyncio.Event()  # the next full pass hangs in the runtime
        lists = store.lists
        h.sets.resync()
        await wait_for(lambda: store.lists > lists, what="a full pass on its way")
        write(tmp_path / "a.yaml", own("big", ["reg.local/old:1", "reg.local/new:1", "reg.local/here:1"]))
        store.add("reg.local/here:1")  # pulled by someone else: found by its ImageStatus
        await wait_for(lambda: store.finished == ["reg.local/new:1"], what="the new image pulled during the list")
        assert store.lists == lists + 1 and h.set_status("big")["present"] == 3
        passes = h.sets.reconciler.passes
        store.list_gate.set()  # its answer is from before both: it neither re-pulls nor forgets them
        await wait_for(lambda: h.sets.reconciler.passes > passes, what="the full pass to land")
        assert h.set_status("big")["present"] == 3 and store.pulls == ["reg.local/new:1"]


async def test_a_probe_that_fails_while_the_full_pass_is_on_its_way_is_tried_again_after_it(runtime, tmp_path) -> None:
    """ImageStatus fails once for an image declared while the list is on its way: the image is
    looked up again once the list has landed (not at the next resync, a minute later), and the
    failing lookup is not repeated at every wake of the loop meanwhile."""
    store = FakeImages(runtime).install()
    store.add("reg.local/old:1")
    status = runtime.unary[SERVICE + "ImageStatus"]
    failed: list[bytes] = []

    async def flaky(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if not failed:
            failed.append(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "transient")
        return await status(request, context)

    (tmp_path / "a.yaml").write_text(own("big", ["reg.local/old:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "big", 1)
        runtime.unary[SERVICE + "ImageStatus"] = flaky
        store.list_gate = asyncio.Event()
        lists = store.lists
        h.sets.resync()
        await wait_for(lambda: store.lists > lists, what="a full pass on its way")
        write(tmp_path / "a.yaml", own("big", ["reg.local/old:1", "reg.local/new:1"]))
        await wait_for(lambda: bool(failed and h.status()["runtime_error"]), what="the lookup to fail")
        for _ in range(5):  # wakes of the loop while the list is on its way
            h.sets.reconciler.configure(h.sets.reconciler.cfg)
            await asyncio.sleep(0.02)
        assert len(failed) == 1 and store.pulls == []
        store.list_gate.set()
        await wait_for(lambda: store.finished == ["reg.local/new:1"], what="new:1 pulled after the failed lookup")
        await reconciled(h, "big", 2)


async def test_a_failing_image_the_runtime_got_while_the_full_pass_was_on_its_way_turns_present(runtime,
                                                                                                  tmp_path) -> None:
    """A prefetch keeps failing (no credentials on the node) and kubelet pulls the image with the
    pod's secret. The list that first shows it lands while its retry is on the way: it is not
    decided by that list, and a later pass sees it appear (before: failed for good, retried and
    failing every retry_max_seconds although the runtime had it)."""
    store = FakeImages(runtime).install()
    store.add("reg.local/old:1")
    store.fail("reg.local/x:1", 10_000, grpc.StatusCode.UNAUTHENTICATED)
    (tmp_path / "a.yaml").write_text(own("s", ["reg.local/old:1", "reg.local/x:1"]))
    async with image_sets(runtime, tmp_path, retry_initial_seconds=0.2, retry_max_seconds=0.2) as h:
        await wait_for(lambda: h.status()["images"]["failed"] == 1, what="x failed")
        store.add("reg.local/x:1")  # kubelet pulled it
        store.list_gate = asyncio.Event()
        lists, pulls = store.lists, len(store.pulls)
        h.sets.resync()
        await wait_for(lambda: store.lists > lists, what="a full pass on its way")
        await wait_for(lambda: len(store.pulls) > pulls and h.status()["images"]["failed"] == 1,
                         what="x retried (and failed again) while the list is on its way")
        passes = h.sets.reconciler.passes
        store.list_gate.set()
        await wait_for(lambda: h.sets.reconciler.passes > passes, what="the list to land")
        store.list_gate = None
        h.sets.reconciler.resync_seconds = 0.05  # later passes (one may land while a retry is pulling)
        h.sets.resync()
        await reconciled(h, "s", 2)
        assert h.status()["images"]["failed"] == 0
