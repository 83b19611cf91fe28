"""Image sets against a scripted runtime: only the difference is pulled, removals cancel,
failures retry without blocking, the disk guard holds pulls back, pins follow the files."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Mapping

import grpc
import pytest

from shim.config import ImageSetsConfig
from shim.imagesets.manager import ImageSets
from shim.imagesets.reconciler import Environment
from shim.observability.metrics import Metrics
from shim.images.pin_set import PinSet
from shim.pulls.scheduler import Priority, PullKey, PullScheduler
from shim.cri.upstream import Upstream
from tests.support.prefetch_store import FakeImages
from tests.support.fake_runtime import FakeRuntime
from tests.support.wait import wait_for

PULL = "/runtime.v1.ImageService/PullImage"


@pytest.fixture
def store(runtime: FakeRuntime) -> FakeImages:
    return FakeImages(runtime).install()


def own(name: str, images: list[str], pin: bool = False) -> str:
    items = "".join(f"    - name: {i}\n" for i in images)
    return (f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata:\n  name: {name}\n"
            f"spec:\n  pin: {str(pin).lower()}\n  images:\n{items if images else '    []'}\n")


def pinned(name: str, images: list[str]) -> str:
    items = "".join(f"    - name: {i}\n" for i in images)
    return (f"apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\nmetadata:\n  name: {name}\n"
            f"spec:\n  pinnedImages:\n{items}")


def write(path: Path, text: str) -> None:
    """Replace a file's content the way an editor or ConfigMap update does (atomic rename)."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclasses.dataclass
class Harness:
    sets: ImageSets
    scheduler: PullScheduler
    metrics: Metrics
    pin_updates: list[Mapping[str, str]]
    disk: dict[str, int]
    upstream: Upstream

    def status(self) -> dict[str, Any]:
        return self.sets.status()

    def set_status(self, name: str) -> dict[str, Any]:
        return self.status()["sets"][name]

    @property
    def pins(self) -> PinSet:
        return PinSet.build((), self.pin_updates[-1] if self.pin_updates else {})

    def gauge(self, name: str, state: str) -> float | None:
        return self.metrics.registry.get_sample_value("cri_shim_image_set_images", {"set": name, "state": state})


@contextlib.asynccontextmanager
async def image_sets(runtime: FakeRuntime, directory: Path, *, use_inotify: bool = True,
                     scheduler_cap: int = 4, free_bytes: int = 10 << 30, options: dict[str, Any] | None = None,
                     load_state: bool = False, **cfg: Any) -> AsyncIterator[Harness]:
    settings = dict(dir=str(directory), max_parallel=2, debounce_seconds=0.05, retry_initial_seconds=0.05,
                    retry_max_seconds=0.2, docker_config=(), state_file="")
    settings.update(cfg)
    config = ImageSetsConfig(**settings)
    upstream = Upstream(runtime.endpoint, 16 << 20)
    metrics = Metrics()
    scheduler = PullScheduler(scheduler_cap, config.max_parallel, observers=[metrics])
    pin_updates: list[Mapping[str, str]] = []
    disk = {"free": free_bytes}

    def statvfs(path: str) -> SimpleNamespace:
        assert path == "/var/lib/fake-runtime/images"
        return SimpleNamespace(f_bavail=disk["free"] // 4096, f_frsize=4096)

    h = Harness(None, scheduler, metrics, pin_updates, disk, upstream)  # type: ignore[arg-type]
    h.sets = ImageSets(config, upstream, scheduler, metrics, on_pins=pin_updates.append, pins=lambda: h.pins,
                       use_inotify=use_inotify, poll_seconds=0.05,
                       env=Environment(statvfs=statvfs, disk_recheck_seconds=0.05),
                       **(options or {}))
    if load_state:  # as the app does, before serving
        h.sets.load_state()
    await h.sets.start()
    try:
        yield h
    finally:
        await h.sets.stop()
        await upstream.close()


async def reconciled(h: Harness, name: str, present: int, timeout: float = 5.0) -> dict[str, Any]:
    await wait_for(lambda: name in h.status()["sets"] and h.set_status(name)["present"] == present
                     and h.status()["images"]["unknown"] == 0, timeout, f"{name} to have {present} present")
    return h.set_status(name)


async def test_all_present_at_start_pulls_nothing_and_pins_all(runtime, store, tmp_path) -> None:
    refs = [f"registry.local/app{i}:v1" for i in range(300)]
    store.add(*refs)
    (tmp_path / "sets.yaml").write_text(pinned("release", refs))
    async with image_sets(runtime, tmp_path) as h:
        s = await reconciled(h, "release", 300)
        assert s["declared"] == 300 and s["pinned"] == 300 and s["failed"] == s["pulling"] == 0
        assert store.pulls == [] and store.lists == 1
        assert h.gauge("release", "present") == 300 and h.gauge("release", "declared") == 300
        assert len(h.pin_updates[-1]) == 300


async def test_only_missing_images_are_pulled_as_declared_without_auth(runtime, store, tmp_path) -> None:
    store.add("nginx:1", "redis:7")
    (tmp_path / "a.yaml").write_text(own("warm", ["nginx:1", "redis:7", "busybox:1.36",
                                                  f"quay.io/x/y@sha256:{'b' * 64}"]))
    async with image_sets(runtime, tmp_path) as h:
        s = await reconciled(h, "warm", 4)
        assert sorted(store.pulls) == ["busybox:1.36", f"quay.io/x/y@sha256:{'b' * 64}"]
        assert all(not r.HasField("auth") and not r.HasField("sandbox_config") for r in store.pull_requests)
        assert "pinned" not in s and h.pin_updates[-1] == {}  # keep-present set: nothing pinned
        assert h.metrics.registry.get_sample_value("cri_shim_pull_requests_total", {"priority": "background"}) == 2


async def test_background_lanes_respect_max_parallel(runtime, store, tmp_path) -> None:
    store.hold_all = asyncio.Event()
    refs = [f"registry.local/img{i}:1" for i in range(8)]
    (tmp_path / "a.yaml").write_text(own("many", refs))
    async with image_sets(runtime, tmp_path, max_parallel=3) as h:
        await wait_for(lambda: len(store.pulls) == 3)
        await asyncio.sleep(0.1)  # nothing more may start while three are held
        assert len(store.pulls) == 3
        s = h.set_status("many")
        assert s["pulling"] == 3 and s["queued"] == 5
        store.hold_all.set()
        await reconciled(h, "many", 8)
        assert store.max_active == 3 and sorted(store.pulls) == sorted(refs)


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "poll"])
async def test_appending_pulls_exactly_the_new_images(runtime, store, tmp_path, use_inotify) -> None:
    refs = [f"registry.local/base{i}:1" for i in range(200)]
    store.add(*refs)
    f = tmp_path / "sets.yaml"
    f.write_text(pinned("release", refs))
    async with image_sets(runtime, tmp_path, use_inotify=use_inotify) as h:
        await reconciled(h, "release", 200)
        assert h.status()["watch"] == ("inotify" if use_inotify else "poll")
        extra = [f"registry.local/new{i}:1" for i in range(10)]
        write(f, pinned("release", refs + extra))
        s = await reconciled(h, "release", 210)
        assert sorted(store.pulls) == sorted(extra)
        assert s["pinned"] == 210 and s["generation"] != ""


async def test_dropping_images_unpins_them_and_leaves_them(runtime, store, tmp_path) -> None:
    refs = [f"registry.local/app{i}:1" for i in range(20)]
    store.add(*refs)
    f = tmp_path / "sets.yaml"
    f.write_text(pinned("release", refs))
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "release", 20)
        assert h.pins.match(["registry.local/app19:1"]) is not None
        write(f, pinned("release", refs[:10]))
        s = await reconciled(h, "release", 10)
        assert s["declared"] == 10 and s["pinned"] == 10
        assert h.pins.match(["registry.local/app19:1"]) is None
        assert h.pins.match(["registry.local/app0:1"]) == "registry.local/app0:1"
        assert all(store.has(r) for r in refs)  # nothing removed: kubelet GC decides
        assert not runtime.calls("RemoveImage") and store.pulls == []


async def test_edit_while_prefetching_cancels_removed_pulls(runtime, store, tmp_path) -> None:
    keep = ["registry.local/keep0:1", "registry.local/keep1:1"]
    drop = ["registry.local/drop0:1", "registry.local/drop1:1", "registry.local/drop2:1"]
    for r in keep + drop:
        store.hold(r)
    f = tmp_path / "sets.yaml"
    f.write_text(own("warm", drop + keep))
    async with image_sets(runtime, tmp_path, max_parallel=2) as h:
        await wait_for(lambda: len(store.pulls) == 2)  # drop0 and drop1 running, the rest queued
        assert store.pulls == drop[:2]
        write(f, own("warm", keep))
        await wait_for(lambda: sorted(store.cancelled) == drop[:2], what="running pulls cancelled")
        for r in keep:
            store.hold(r).set()
        s = await reconciled(h, "warm", 2)
        assert s["declared"] == 2
        assert "registry.local/drop2:1" not in store.pulls  # queued one never went upstream
        assert sorted(store.finished) == sorted(keep)
        assert h.scheduler.in_flight == 0 and h.scheduler.queued == 0


async def test_a_kubelet_pull_sharing_a_dropped_prefetch_is_not_cancelled(runtime, store, tmp_path) -> None:
    gate = store.hold("registry.local/shared:1")
    f = tmp_path / "sets.yaml"
    f.write_text(own("warm", ["registry.local/shared:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await wait_for(lambda: store.pulls == ["registry.local/shared:1"])

        async def kubelet_run() -> bytes:
            raise AssertionError("kubelet's pull must join the running prefetch")

        kubelet = asyncio.ensure_future(h.scheduler.pull(PullKey(image="registry.local/shared:1",
                                                                 requested="registry.local/shared:1"), kubelet_run,
                                                         priority=Priority.FOREGROUND))
        await wait_for(lambda: [r["waiters"] for r in h.scheduler.snapshot()["in_flight"]] == [2],
                         what="kubelet's pull joined the prefetch")
        write(f, own("warm", []))
        await wait_for(lambda: h.status()["sets"]["warm"]["declared"] == 0)
        await asyncio.sleep(0.05)
        assert not kubelet.done() and store.cancelled == []
        gate.set()
        outcome = await asyncio.wait_for(kubelet, 5)
        assert outcome.joined and store.finished == ["registry.local/shared:1"]


async def test_failures_retry_with_backoff_and_do_not_block_others(runtime, store, tmp_path, caplog) -> None:
    store.fail("registry.local/flaky:1", 3, grpc.StatusCode.UNAVAILABLE)
    store.fail("registry.local/gone:1", 1000)
    refs = ["registry.local/flaky:1", "registry.local/gone:1"] + [f"registry.local/ok{i}:1" for i in range(6)]
    (tmp_path / "a.yaml").write_text(own("warm", refs))
    caplog.set_level(logging.WARNING, logger="cri_shim")
    async with image_sets(runtime, tmp_path, retry_initial_seconds=0.02, retry_max_seconds=0.08) as h:
        s = await reconciled(h, "warm", 7)  # all but the one that never comes
        assert store.pulls.count("registry.local/flaky:1") == 4
        await wait_for(lambda: store.pulls.count("registry.local/gone:1") >= 4)
        snap: dict = {}

        def between_retries() -> bool:  # it is "pulling" while a retry is under way
            snap["set"], snap["all"] = h.set_status("warm"), h.status()
            return snap["set"]["failed"] == 1 and bool(snap["all"]["failed"])
        await wait_for(between_retries)
        s = snap["set"]
        assert s["failed"] == 1 and "registry.local/gone:1: NOT_FOUND" in s["last_error"]
        [row] = snap["all"]["failed"]
        assert row["image"] == "registry.local/gone:1" and row["attempts"] >= 3
        assert 0 <= row["retry_in_seconds"] <= 0.08 + 0.01  # capped at retry_max_seconds
    assert "image set pull failed; will retry" in caplog.text


async def test_disk_guard_holds_pulls_and_says_why(runtime, store, tmp_path) -> None:
    (tmp_path / "a.yaml").write_text(own("warm", ["registry.local/a:1", "registry.local/b:1"]))
    async with image_sets(runtime, tmp_path, free_bytes=1 << 30, min_free_bytes=5 << 30) as h:
        await wait_for(lambda: h.status()["disk"]["blocked"] != "", what="disk guard to block")
        status = h.status()
        assert "free space on /var/lib/fake-runtime/images is 1 GiB, below image_sets.min_free_bytes 5 GiB" \
            in status["disk"]["blocked"]
        assert status["sets"]["warm"]["queued"] == 2 and "below" in status["sets"]["warm"]["last_error"]
        await asyncio.sleep(0.2)  # several rechecks: still short, still nothing pulled
        assert store.pulls == []
        h.disk["free"] = 6 << 30
        await reconciled(h, "warm", 2)
        assert h.status()["disk"]["blocked"] == "" and h.status()["disk"]["free_bytes"] == 6 << 30


async def test_cooldown_pauses_between_background_pulls(runtime, store, tmp_path) -> None:
    refs = [f"registry.local/cp{i}:1" for i in range(3)]
    starts: list[float] = []
    original = runtime.unary[PULL]

    async def timed(request: bytes, context) -> bytes:
        starts.append(asyncio.get_running_loop().time())
        return await original(request, context)

    runtime.unary[PULL] = timed
    (tmp_path / "a.yaml").write_text(own("cp", refs))
    async with image_sets(runtime, tmp_path, max_parallel=1, cooldown_seconds=0.15) as h:
        await reconciled(h, "cp", 3)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 2 and all(g >= 0.14 for g in gaps)


async def test_bad_file_keeps_previous_content_while_others_reconcile(runtime, store, tmp_path, caplog) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(pinned("alpha", ["registry.local/a:1"]))
    b.write_text(own("beta", ["registry.local/b:1"]))
    caplog.set_level(logging.ERROR, logger="cri_shim")
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "alpha", 1)
        await reconciled(h, "beta", 1)
        write(a, "apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\nspec: [broken\n")
        write(b, own("beta", ["registry.local/b:1", "registry.local/b:2"]))
        await reconciled(h, "beta", 2)
        await wait_for(lambda: str(a) in h.status()["file_errors"])
        assert h.set_status("alpha")["declared"] == 1 and h.set_status("alpha")["pinned"] == 1
        assert "not valid YAML" in h.status()["file_errors"][str(a)]
        assert "image set file rejected; its previous content stays in force" in caplog.text
        write(a, pinned("alpha", ["registry.local/a:1", "registry.local/a:2"]))
        await reconciled(h, "alpha", 2)
        assert h.status()["file_errors"] == {}


async def test_progress_is_logged_at_quarters(runtime, store, tmp_path, caplog) -> None:
    refs = [f"registry.local/p{i}:1" for i in range(8)]
    store.add(*refs[:2])
    (tmp_path / "a.yaml").write_text(own("prog", refs))
    caplog.set_level(logging.INFO, logger="cri_shim.imagesets")

    def steps() -> list[int]:
        return [r.fields["percent"] for r in caplog.records  # type: ignore[attr-defined]
                if r.getMessage() == "image set progress"]

    async with image_sets(runtime, tmp_path, max_parallel=1) as h:
        await reconciled(h, "prog", 8)
        # The status counts an image present as its pull ends; the progress line is written by the
        # reconciler's next pass, which may come a moment later: wait for it, not for the status.
        await wait_for(lambda: 100 in steps(), 5.0, "the 100 % progress line")
    assert steps() == [25, 50, 75, 100]


async def test_runtime_unavailable_is_reported_and_recovered(runtime, store, tmp_path) -> None:
    store.list_error = grpc.StatusCode.UNAVAILABLE
    (tmp_path / "a.yaml").write_text(own("warm", ["registry.local/a:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await wait_for(lambda: h.status()["runtime_error"] != "")
        assert "ListImages failed: UNAVAILABLE" in h.status()["runtime_error"]
        assert "UNAVAILABLE" in h.set_status("warm")["last_error"]
        store.list_error = None
        await reconciled(h, "warm", 1)
        assert h.status()["runtime_error"] == ""


async def test_images_removed_behind_our_back_come_back_on_resync(runtime, store, tmp_path) -> None:
    store.add("registry.local/a:1")
    (tmp_path / "a.yaml").write_text(own("warm", ["registry.local/a:1"]))
    async with image_sets(runtime, tmp_path) as h:
        h.sets.reconciler.runtime.resync_seconds = 0.1
        await reconciled(h, "warm", 1)
        store.remove("registry.local/a:1")
        await wait_for(lambda: store.pulls == ["registry.local/a:1"] and store.has("registry.local/a:1"))


async def test_sets_removed_and_restored_share_images(runtime, store, tmp_path) -> None:
    (tmp_path / "a.yaml").write_text(pinned("alpha", ["registry.local/shared:1"]))
    (tmp_path / "b.yaml").write_text(own("beta", ["registry.local/shared:1"]))
    async with image_sets(runtime, tmp_path) as h:
        await reconciled(h, "alpha", 1)
        assert store.pulls == ["registry.local/shared:1"]  # one image, one pull, whatever declares it
        (tmp_path / "a.yaml").unlink()
        await wait_for(lambda: "alpha" not in h.status()["sets"])
        assert h.pin_updates[-1] == {} and h.set_status("beta")["present"] == 1
        await wait_for(lambda: h.gauge("alpha", "declared") is None, what="removed set's gauge series to go")
