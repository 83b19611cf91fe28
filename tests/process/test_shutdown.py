"""SIGTERM to a shim process in the middle of a pull storm: no call hangs, queued pulls
get UNAVAILABLE (kubelet retries), in-flight ones finish, exit 0 within the grace
period, the socket is gone."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from shim.process.admin import fetch_status
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import shim_process
from tests.support.slow_pulls import PULL, VERSION, SlowPulls, pull_request


async def _outcome(call) -> tuple[str, float]:
    """(status name, monotonic time it ended); every call has a deadline."""
    try:
        await call
        return "OK", time.monotonic()
    except grpc.aio.AioRpcError as e:
        return e.code().name, time.monotonic()


async def test_sigterm_during_storm(runtime: FakeRuntime, tmp_path, engine: str) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(1.5)

    async def slow_version(request: bytes, context) -> bytes:
        await asyncio.sleep(1.0)
        return b"\x0a\x050.1.0"
    runtime.unary[VERSION] = slow_version

    grace = 5.0
    async with shim_process(runtime.endpoint, tmp_path,
                            {"pulls": {"max_parallel": 2},
                             "server": {"shutdown_grace_seconds": grace, "engine": engine}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull, version = ch.unary_unary(PULL), ch.unary_unary(VERSION)
            calls = [asyncio.ensure_future(_outcome(pull(pull_request(f"registry.test/storm/{i}:1"), timeout=30)))
                     for i in range(8)]
            await pulls.wait_current(2)
            in_flight = list(pulls.started)
            slow = asyncio.ensure_future(_outcome(version(b"", timeout=30)))
            for _ in range(500):  # wait until the Version call is in the runtime
                if runtime.calls("Version"):
                    break
                await asyncio.sleep(0.01)
            assert runtime.calls("Version")

            t_term = time.monotonic()
            shim.terminate()
            results = await asyncio.wait_for(asyncio.gather(*calls), grace + 5)
            code = await shim.await_exit(grace + 5)
            exited_after = time.monotonic() - t_term
            version_result = await slow

            # a call made after SIGTERM fails fast instead of hanging
            t_late = time.monotonic()
            late = await _outcome(ch.unary_unary(VERSION)(b"", timeout=10))

    log = shim.logs()
    statuses = [r[0] for r in results]
    assert statuses.count("OK") == 2, (results, in_flight, pulls.started, pulls.finished, pulls.cancelled, log)  # the two in-flight pulls finished
    assert statuses.count("UNAVAILABLE") == 6, statuses  # the queued ones: kubelet will retry
    refused_after = max(t for s, t in results if s == "UNAVAILABLE") - t_term
    assert refused_after < 1.0, ("queued pulls must be refused at once, not after the in-flight ones", log)
    assert sorted(pulls.finished) == sorted(in_flight) and pulls.cancelled == []
    assert len(pulls.started) == 2  # no queued pull reached the runtime after SIGTERM
    assert version_result[0] == "OK", (version_result, log)  # an in-flight passthrough call finished too
    assert code == 0
    assert exited_after < grace, log  # everything finished early: no need to wait the whole grace
    assert late[0] == "UNAVAILABLE" and late[1] - t_late < 5
    assert not os.path.exists(shim.path)
    assert "shutting down" in log and "msg=stopped" in log and "Traceback" not in log, log


async def test_in_flight_call_longer_than_grace_is_cut_at_grace(runtime: FakeRuntime, tmp_path, engine: str) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(60)
    grace = 1.0
    async with shim_process(runtime.endpoint, tmp_path,
                            {"server": {"shutdown_grace_seconds": grace, "engine": engine}}) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = asyncio.ensure_future(_outcome(ch.unary_unary(PULL)(pull_request("registry.test/huge:1"),
                                                                       timeout=60)))
            await pulls.wait_current(1)
            t_term = time.monotonic()
            shim.terminate()
            code = await shim.await_exit(grace + 10)
            exited_after = time.monotonic() - t_term
            status, _ = await asyncio.wait_for(call, 5)
    assert code == 0
    assert grace <= exited_after < grace + 3
    assert status in ("CANCELLED", "UNAVAILABLE")  # kubelet sees an error and retries; nothing hangs
    for _ in range(100):  # the runtime's pull is cancelled too, not left running
        if pulls.cancelled:
            break
        await asyncio.sleep(0.02)
    assert pulls.cancelled == ["registry.test/huge:1"]
    assert not os.path.exists(shim.path)


async def test_queued_pull_gets_retryable_message(runtime: FakeRuntime, tmp_path, short_tmp, engine: str) -> None:
    pulls = runtime.unary[PULL] = SlowPulls(1.0)
    admin = str(short_tmp / "admin.sock")
    settings = {"pulls": {"max_parallel": 1}, "server": {"engine": engine, "admin_socket": admin}}
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            pull = ch.unary_unary(PULL)
            first = asyncio.ensure_future(pull(pull_request("registry.test/a:1"), timeout=30))
            await pulls.wait_current(1)
            queued = asyncio.ensure_future(pull(pull_request("registry.test/b:1"), timeout=30))
            while not (await asyncio.to_thread(fetch_status, admin))["pulls"]["queued"]:  # `cri-shim status`
                await asyncio.sleep(0.02)
            shim.terminate()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await queued
            await first
            assert await shim.await_exit(10) == 0
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert e.value.details().startswith("cri-shim:") and "shutting down" in e.value.details()
