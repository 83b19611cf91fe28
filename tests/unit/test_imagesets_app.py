"""Image sets wired into a running shim: pins seen through CRI, kubelet never waits for a
reconcile, reloads start, reconfigure and stop image sets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from shim import config as config_mod
from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim
from tests.support.prefetch_store import FakeImages, image_id
from tests.unit.test_imagesets import own, pinned, write
from tests.support.wait import wait_for

LIST = "/runtime.v1.ImageService/ListImages"
PULL = "/runtime.v1.ImageService/PullImage"
REMOVE = "/runtime.v1.ImageService/RemoveImage"


async def start_runtime(tmp_path: Path) -> tuple[FakeRuntime, FakeImages]:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    return rt, FakeImages(rt).install()


def settings(directory: Path, **extra) -> dict:
    return {"image_sets": {"dir": str(directory), "debounce_seconds": 0.05, "retry_initial_seconds": 0.05,
                           "retry_max_seconds": 0.1, "state_file": str(directory.parent / "file-sets.json"), **extra},
            "pins": {"ledger_file": str(directory.parent / "pins.json")}}


async def listed_pins(ch: grpc.aio.Channel) -> dict[str, bool]:
    raw = await ch.unary_unary(LIST)(b"", timeout=5)
    return {i.repo_tags[0]: i.pinned for i in api_pb2.ListImagesResponse.FromString(raw).images}


async def test_declared_pins_show_in_list_images_and_block_removal(tmp_path: Path) -> None:
    rt, store = await start_runtime(tmp_path)
    sets = tmp_path / "sets"
    sets.mkdir()
    store.add("registry.local/a:1", "registry.local/b:1", "registry.local/other:1")
    write(sets / "p.yaml", pinned("release", ["registry.local/a:1", "registry.local/b:1"]))
    write(sets / "w.yaml", own("warm", ["registry.local/other:1"]))
    try:
        async with running_shim(rt.endpoint, settings(sets)) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                await wait_for(lambda: shim.app.image_sets_status().get("sets", {}).get("release", {})
                                 .get("pinned") == 2)
                assert await listed_pins(ch) == {"registry.local/a:1": True, "registry.local/b:1": True,
                                                 "registry.local/other:1": False}
                doc = shim.app.status()["image_sets"]  # what `cri-shim status` shows
                assert doc["enabled"] and doc["watch"] == "inotify" and doc["file_errors"] == {}
                assert doc["sets"]["release"]["present"] == 2 and doc["sets"]["warm"]["pin"] is False
                rm = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image="registry.local/a:1"))
                try:
                    await ch.unary_unary(REMOVE)(rm.SerializeToString(), timeout=5)
                    raise AssertionError("a pinned image was removed")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in e.details()

                write(sets / "p.yaml", pinned("release", ["registry.local/a:1"]))  # b dropped: unpinned
                async def b_unpinned() -> bool:
                    return (await listed_pins(ch))["registry.local/b:1"] is False
                for _ in range(200):
                    if await b_unpinned():
                        break
                    await asyncio.sleep(0.02)
                assert (await listed_pins(ch))["registry.local/a:1"] is True
                assert store.has("registry.local/b:1") and not rt.calls("RemoveImage")
    finally:
        await rt.stop()


async def test_kubelet_pulls_are_served_while_a_reconcile_waits_on_the_runtime(tmp_path: Path) -> None:
    rt, store = await start_runtime(tmp_path)
    store.list_gate = asyncio.Event()  # the reconciler's ListImages hangs
    sets = tmp_path / "sets"
    sets.mkdir()
    write(sets / "w.yaml", own("warm", ["registry.local/a:1"]))
    try:
        async with running_shim(rt.endpoint, settings(sets)) as shim:
            await wait_for(lambda: store.lists >= 1, what="reconciler to ask for the image list")
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                req = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="registry.local/kubelet:1"))
                raw = await ch.unary_unary(PULL)(req.SerializeToString(), timeout=5)
                assert api_pb2.PullImageResponse.FromString(raw).image_ref == image_id("registry.local/kubelet:1")
            assert store.pulls == ["registry.local/kubelet:1"]
            store.list_gate.set()
            await wait_for(lambda: store.has("registry.local/a:1"))
    finally:
        await rt.stop()


async def test_reload_reconfigures_moves_and_turns_off_image_sets(tmp_path: Path, monkeypatch) -> None:
    rt, store = await start_runtime(tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    store.add("registry.local/a:1", "registry.local/b:1")
    write(first / "p.yaml", pinned("one", ["registry.local/a:1"]))
    write(second / "p.yaml", pinned("two", ["registry.local/b:1"]))
    try:
        async with running_shim(rt.endpoint, settings(first)) as shim:
            app = shim.app
            await wait_for(lambda: app.image_sets_status().get("sets", {}).get("one", {}).get("pinned") == 1)
            assert app.images.pins.match(["registry.local/a:1"]) is not None

            await app.reload(config_mod.from_dict({**settings(first, max_parallel=3, cooldown_seconds=0.5),
                                                   "listen": shim.endpoint, "upstream": rt.endpoint}))
            assert app.scheduler.background_max_parallel == 3
            assert app.image_sets is not None and app.image_sets.reconciler.cfg.cooldown_seconds == 0.5

            # a new dir: removals wait for it to be read; the old dir's sets stay in the pin ledger (no
            # source confirms they are gone: a reload never unpins)
            scans = HeldScans(monkeypatch)
            await app.reload(config_mod.from_dict({**settings(second), "listen": shim.endpoint,
                                                   "upstream": rt.endpoint}))
            assert await asyncio.to_thread(scans.entered.wait, 10)
            assert app.images.pins.match(["registry.local/a:1"]) is not None
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                early = asyncio.ensure_future(removal(ch, "registry.local/b:1"))
                await wait_for(lambda: sum(len(c.tasks) for c in shim.server.relay.connections) == 1)
                scans.release.set()
                assert (await early)[0] is grpc.StatusCode.FAILED_PRECONDITION  # pinned by the new dir
            await wait_for(lambda: "two" in app.image_sets_status().get("sets", {}))
            assert app.images.pins.match(["registry.local/a:1"]) is not None  # "one", kept by the ledger
            assert app.images.pins.match(["registry.local/b:1"]) is not None
            assert app.image_sets_status()["pin_ledger"]["pinned_not_in_force"] == ["one"]

            await app.reload(config_mod.from_dict({"listen": shim.endpoint, "upstream": rt.endpoint,
                                                   "pins": settings(second)["pins"]}))
            assert app.image_sets_status() == {"enabled": False}
            assert {e.name for e in app.ledger} == {"one", "two"}  # image sets off: the pins stay
            assert app.images.pins.match(["registry.local/b:1"]) is not None
            assert store.has("registry.local/a:1") and store.has("registry.local/b:1")
    finally:
        await rt.stop()


class HeldScans:
    """SetDirectory.scan held until released: the shim serves before its first scan ends."""

    def __init__(self, monkeypatch) -> None:
        import threading

        from shim.imagesets.loader import SetDirectory
        self.entered, self.release = threading.Event(), threading.Event()
        real = SetDirectory.scan

        def held(directory):
            self.entered.set()
            self.release.wait(30)
            return real(directory)
        monkeypatch.setattr(SetDirectory, "scan", held)


async def removal(ch: grpc.aio.Channel, name: str) -> tuple[grpc.StatusCode, str]:
    rm = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name)).SerializeToString()
    try:
        await ch.unary_unary(REMOVE)(rm, timeout=20)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


@pytest.mark.parametrize("scan_ends", [True, False], ids=["scan-ends", "scan-hangs"])
async def test_pins_are_enforced_from_the_first_call(tmp_path: Path, monkeypatch, scan_ends: bool) -> None:
    """A RemoveImage that arrives before the first scan of image_sets.dir waits for it: refused
    once the pinning set is read, UNAVAILABLE after image_sets.pins_wait_seconds if never."""
    rt, store = await start_runtime(tmp_path)
    sets = tmp_path / "sets"
    sets.mkdir()
    store.add("registry.local/a:1")
    write(sets / "p.yaml", pinned("release", ["registry.local/a:1"]))
    scans = HeldScans(monkeypatch)
    try:
        async with running_shim(rt.endpoint, settings(sets, pins_wait_seconds=30 if scan_ends else 0.2)) as shim:
            async with grpc.aio.insecure_channel(shim.endpoint) as ch:
                assert await asyncio.to_thread(scans.entered.wait, 10)
                early = asyncio.ensure_future(removal(ch, "registry.local/a:1"))
                if scan_ends:
                    await wait_for(lambda: sum(len(c.tasks) for c in shim.server.relay.connections) == 1)
                    assert not early.done() and not rt.calls("ImageStatus")  # the call is in the shim, waiting
                    scans.release.set()
                code, details = await early
                if scan_ends:
                    assert code is grpc.StatusCode.FAILED_PRECONDITION and "image set 'release'" in details
                else:
                    assert code is grpc.StatusCode.UNAVAILABLE and "image_sets.pins_wait_seconds" in details
                assert store.has("registry.local/a:1") and not rt.calls("RemoveImage")
    finally:
        scans.release.set()
        await rt.stop()
