"""Reload of a running shim process (SIGHUP or a changed config file) under traffic:
the runtime sees the new pull cap, no call fails, a bad config is refused and logged."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import shim_process
from tests.support.slow_pulls import PULL, VERSION, SlowPulls, Storm, pull_request


@pytest.fixture
def runtime(runtime: FakeRuntime) -> FakeRuntime:
    """the runtime fixture (tests/support/fake_fixtures.py), answering Version."""
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    return runtime


def settings(max_parallel: int, engine: str = "relay") -> dict:
    return {"pulls": {"max_parallel": max_parallel}, "server": {"admin_socket": "", "engine": engine}}


@pytest.mark.parametrize("engine", ["relay", "grpc"])
async def test_reload_changes_cap_under_traffic_without_failing_a_call(runtime: FakeRuntime, tmp_path,
                                                                       engine: str) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(0.2)
    async with shim_process(runtime.endpoint, tmp_path, settings(2, engine)) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            storm = Storm(ch, workers=8).start()
            try:
                await pulls.wait_current(2)
                await asyncio.sleep(1.0)
                assert pulls.max == 2  # the cap from the file at start

                # SIGHUP raises the cap: queued pulls start at once.
                shim.write_config(settings(5, engine))
                shim.reload()
                mark = await shim.await_log('msg="config reloaded" reason=SIGHUP')
                await pulls.wait_current(5)
                pulls.reset_max()
                await asyncio.sleep(1.0)
                assert pulls.max == 5

                # A changed file alone (no signal) lowers it: running pulls finish, no new ones start.
                shim.write_config(settings(1, engine))
                await shim.await_log('msg="config reloaded" reason="config file changed"', after=mark)
                await pulls.wait_at_most(1)
                pulls.reset_max()
                await asyncio.sleep(1.0)
                assert pulls.max == 1
            finally:
                await storm.stop()
    assert storm.errors == []
    assert storm.ok >= 10 and storm.versions_ok >= 10
    assert pulls.cancelled == []


async def test_bad_config_is_logged_and_ignored(runtime: FakeRuntime, tmp_path) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(0.2)
    async with shim_process(runtime.endpoint, tmp_path, settings(2)) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            storm = Storm(ch, workers=6).start()
            try:
                await pulls.wait_current(2)
                shim.write_config(settings(-1))
                shim.reload()
                await shim.await_log("config reload rejected")
                line = next(ln for ln in shim.logs().splitlines() if "config reload rejected" in ln)
                assert "pulls.max_parallel" in line and "level=error" in line

                shim.write_config("pulls: [unclosed\n")
                shim.reload()
                await shim.await_log("is not valid YAML")

                pulls.reset_max()
                await asyncio.sleep(1.0)
                assert pulls.max == 2  # the running config is still in force
                assert shim.proc.poll() is None
            finally:
                await storm.stop()
    assert storm.errors == []
    assert "Traceback" not in shim.logs()


async def test_restart_only_keys_are_logged_and_keep_running_value(runtime: FakeRuntime, tmp_path) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(0.05)
    async with shim_process(runtime.endpoint, tmp_path, settings(2)) as shim:
        new = settings(3)
        new["server"].update(shutdown_grace_seconds=1, max_message_bytes="8MiB")
        new["metrics"] = {"address": "127.0.0.1:1"}
        shim.write_config(new)
        shim.reload()
        await shim.await_log('msg="config reloaded"')
        logs = shim.logs()
        for key in ("server.shutdown_grace_seconds", "server.max_message_bytes", "metrics.address"):
            assert re.search(rf'needs a restart.* key={re.escape(key)} ', logs), logs
        reloaded = next(ln for ln in logs.splitlines() if "config reloaded" in ln)
        assert "max_parallel_pulls=3" in reloaded  # the reloadable part was applied
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await asyncio.gather(*(ch.unary_unary(PULL)(_req(i), timeout=10) for i in range(6)))
        assert pulls.max == 3
        exit_code = await shim.astop()
    assert exit_code == 0
    # the running grace (10 s default), not the configured 1 s, is what shutdown used
    assert "grace_seconds=10.0" in shim.logs()


def _req(i: int) -> bytes:
    return pull_request(f"registry.test/restart/{i}:1")


async def test_config_file_deleted_keeps_running_config(runtime: FakeRuntime, tmp_path) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(0.2)
    async with shim_process(runtime.endpoint, tmp_path, settings(2)) as shim:
        shim.config_path.unlink()
        shim.reload()
        await shim.await_log("config file missing; keeping the running config")
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await asyncio.gather(*(ch.unary_unary(PULL)(_req(i), timeout=10) for i in range(6)))
    assert pulls.max == 2  # not the default of 4


async def test_reload_applies_pins_and_handler_rules(runtime: FakeRuntime, tmp_path) -> None:
    """Pins and runtime-handler rules come and go with a reload, no restart."""
    store = FakeImageStore([StoredImage(image_id(1), ["docker.io/library/keep:1"]),
                            StoredImage(image_id(2), ["docker.io/library/keep:2"])])
    store.install(runtime)
    pulled: list[str] = []

    async def pull(request: bytes, context) -> bytes:
        pulled.append(api_pb2.PullImageRequest.FromString(request).image.runtime_handler)
        return api_pb2.PullImageResponse(image_ref=image_id(9)).SerializeToString()
    runtime.unary[PULL] = pull
    remove = "/runtime.v1.ImageService/RemoveImage"

    def remove_req(name: str) -> bytes:
        return api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name)).SerializeToString()

    async with shim_process(runtime.endpoint, tmp_path, settings(2)) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            await ch.unary_unary(PULL)(pull_request("registry.test/app:1"), timeout=10)
            assert pulled == [""]  # no rule yet

            new = settings(2)
            new["pins"] = {"images": ["keep:*"]}
            new["runtime_handlers"] = {"rules": [{"handler": "kata", "images": ["registry.test/app:*"]}]}
            shim.write_config(new)
            shim.reload()
            mark = await shim.await_log('msg="config reloaded"')

            await ch.unary_unary(PULL)(pull_request("registry.test/app:1"), timeout=10)
            assert pulled[-1] == "kata"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(remove)(remove_req("keep:1"), timeout=10)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "pin" in e.value.details()

            shim.write_config(settings(2))  # both gone again
            shim.reload()
            await shim.await_log('msg="config reloaded"', after=mark)
            await ch.unary_unary(PULL)(pull_request("registry.test/app:1"), timeout=10)
            assert pulled[-1] == ""
            await ch.unary_unary(remove)(remove_req("keep:1"), timeout=10)
    assert [img.tags for img in store.images] == [["docker.io/library/keep:2"]]
