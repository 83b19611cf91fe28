"""Soak: the shim as a process under a long mixed load, both engines; RSS and open fds stay flat.

Budget: ``CRI_SHIM_SOAK_SECONDS`` (scripts/test.sh sets 60; 60 if unset), split evenly
between the two engines. Each engine's run aims at 100,000 mixed calls and 1,000 pulls
(200,000 and 2,000 in all) and stops early when its share of the budget is spent: the
counts done are printed (``-s`` or ``-rA``), with RSS and fds before and after.

The runtime is the scripted one (tests/support/runtime_process.py, ``--soak``) in a
process of its own, not containerd: the soak looks for leaks in the shim, so the
runtime should answer in microseconds and hold no state that grows (containerd's
per-call cost would cut the call count by an order of magnitude on this 2-core
machine, and its own memory would blur the shim's). Passthrough against real
containerd is covered by the e2e tests.

Mixed calls: passthrough unary (Version, ListContainers, ImageFsInfo), runtime errors,
deadlines that expire in the runtime, client cancellations, an unknown method
(bidirectional stream), intercepted image calls with pins (ImageStatus, ListImages,
StreamImages, RemoveImage refused), malformed requests, and connection churn (a new
client connection per call). Pulls: the randomized storm of tests/support/pull_chaos
(callers time out or cancel while queued, joined or in flight).

"Flat": RSS and fds are read after a warm-up and at the end, both at a quiet moment
(no call in flight). fds must come back to where they were; RSS may grow by at most
6 MiB (allocator noise; a leak of 64 bytes per call over 100,000 calls would pass it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import SVC
from tests.support.fake_runtime import FAKE_BIDI
from tests.support.fixtures import shim_factory  # noqa: F401  (fixture)
from tests.support.pull_chaos import Tally, image_names, one_caller, settled_gauges
from tests.support.registry import free_port
from tests.support.runtime_process import (CONTAINER_STATUS, LIST_CONTAINERS, SLOW, SOAK_IMAGES, SOAK_STATS,
                                           RuntimeProcess, soak_list_containers, soak_store)

BUDGET = float(os.environ.get("CRI_SHIM_SOAK_SECONDS", "60"))

pytestmark = [pytest.mark.soak, pytest.mark.timeout(BUDGET + 600)]
CALLS, PULLS = 100_000, 1_000  # per engine
CAP = 3
VERSION = "/runtime.v1.RuntimeService/Version"
WORKERS = 24


def rss_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Load:
    endpoint: str
    chans: list[grpc.aio.Channel]
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    done: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    in_flight: int = 0
    # what a malformed ImageStatus gets: the shim's INVALID_ARGUMENT where it intercepts ImageStatus
    # (engine grpc), the runtime's own answer where it is patched (engine relay: the runtime judges it)
    malformed_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT

    def ch(self) -> grpc.aio.Channel:
        return self.rng.choice(self.chans)

    def check(self, op: str, ok: bool, what: object) -> None:
        self.done[op] += 1
        if not ok and len(self.unexpected) < 20:
            self.unexpected.append(f"{op}: {what}")


STORE = soak_store()
PINNED = {img.id for img in STORE.images if img.tags[0].startswith("registry.k8s.io/pause:")}
CONTAINERS = soak_list_containers()


async def code_of(call) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED, None


async def op_version(load: Load) -> None:
    code, r = await code_of(load.ch().unary_unary(VERSION)(b"", timeout=10))
    load.check("Version", r == b"\x0a\x02v1", (code, r))


async def op_list_containers(load: Load) -> None:
    code, r = await code_of(load.ch().unary_unary(LIST_CONTAINERS)(b"", timeout=10))
    load.check("ListContainers", r == CONTAINERS, code)


async def op_fs_info(load: Load) -> None:
    code, r = await code_of(load.ch().unary_unary(SVC + "ImageFsInfo")(b"", timeout=10))
    load.check("ImageFsInfo", code is grpc.StatusCode.OK, code)


async def op_runtime_error(load: Load) -> None:
    code, d = await code_of(load.ch().unary_unary(CONTAINER_STATUS)(b"\x0a\x01c", timeout=10))
    load.check("ContainerStatus(NOT_FOUND)", (code, d) == (grpc.StatusCode.NOT_FOUND, "container not found"), code)


async def op_deadline(load: Load) -> None:
    code, _ = await code_of(load.ch().unary_unary(SLOW)(b"", timeout=0.02))
    load.check("ExecSync(deadline)", code is grpc.StatusCode.DEADLINE_EXCEEDED, code)


async def op_cancel(load: Load) -> None:
    call = load.ch().unary_unary(SLOW)(b"", timeout=10)
    asyncio.get_running_loop().call_later(load.rng.uniform(0, 0.01), call.cancel)
    code, _ = await code_of(call)
    load.check("ExecSync(cancel)", code is grpc.StatusCode.CANCELLED, code)


async def op_bidi(load: Load) -> None:
    call = load.ch().stream_stream(FAKE_BIDI + "Echo")(iter([b"a", b"bc"]), timeout=10)
    try:
        got = [m async for m in call]
    except grpc.aio.AioRpcError as e:
        got = [e.code()]
    load.check("unknown bidi", got == [b"echo:a", b"echo:bc"], got)


def _status_request(i: int) -> bytes:
    return api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=STORE.images[i].id)).SerializeToString()


async def op_image_status(load: Load) -> None:
    i = load.rng.randrange(SOAK_IMAGES)
    code, r = await code_of(load.ch().unary_unary(SVC + "ImageStatus")(_status_request(i), timeout=10))
    ok = code is grpc.StatusCode.OK and \
        api_pb2.ImageStatusResponse.FromString(r).image.pinned == (STORE.images[i].id in PINNED)  # type: ignore
    load.check("ImageStatus", ok, code)


async def op_list_images(load: Load) -> None:
    code, r = await code_of(load.ch().unary_unary(SVC + "ListImages")(b"", timeout=10))
    ok = code is grpc.StatusCode.OK and \
        {i.id for i in api_pb2.ListImagesResponse.FromString(r).images if i.pinned} == PINNED  # type: ignore
    load.check("ListImages", ok, code)


async def op_stream_images(load: Load) -> None:
    n, pinned = 0, set()
    try:
        async for m in load.ch().unary_stream(SVC + "StreamImages")(b"", timeout=10):
            for img in api_pb2.StreamImagesResponse.FromString(m).images:
                n += 1
                if img.pinned:
                    pinned.add(img.id)
    except grpc.aio.AioRpcError as e:
        load.check("StreamImages", False, e.code())
        return
    load.check("StreamImages", n == SOAK_IMAGES and pinned == PINNED, n)


async def op_remove_pinned(load: Load) -> None:
    img = STORE.images[4 * load.rng.randrange(SOAK_IMAGES // 4)]
    req = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=img.tags[0])).SerializeToString()
    code, _ = await code_of(load.ch().unary_unary(SVC + "RemoveImage")(req, timeout=10))
    load.check("RemoveImage(pinned)", code is grpc.StatusCode.FAILED_PRECONDITION, code)


MALFORMED_STATUS = b"\x0a\x05\x0a\x03ng"  # ImageSpec's length says 5, 3 bytes follow


async def op_malformed(load: Load) -> None:
    code, d = await code_of(load.ch().unary_unary(SVC + "ImageStatus")(MALFORMED_STATUS, timeout=10))
    load.check("ImageStatus(malformed)", code is load.malformed_code, (code, d))


async def op_new_connection(load: Load) -> None:
    async with grpc.aio.insecure_channel(load.endpoint) as ch:
        code, r = await code_of(ch.unary_unary(VERSION)(b"", timeout=10))
    load.check("Version(new connection)", r == b"\x0a\x02v1", code)


OPS = [(30, op_version), (8, op_list_containers), (5, op_fs_info), (5, op_runtime_error), (2, op_deadline),
       (3, op_cancel), (4, op_bidi), (15, op_image_status), (6, op_list_images), (3, op_stream_images),
       (5, op_remove_pinned), (2, op_malformed), (4, op_new_connection)]


async def run_load(load: Load, pulls: Tally, until: float, gate: asyncio.Event, calls_target: int,
                   pulls_target: int, seconds: float) -> None:
    """WORKERS call loops and one pull feeder until ``until`` or the targets; pause while ``gate`` is clear."""
    weights = [w for w, _ in OPS]
    fns = [f for _, f in OPS]
    names = image_names()
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        while loop.time() < until and sum(load.done.values()) < calls_target:
            await gate.wait()
            load.in_flight += 1
            try:
                await load.rng.choices(fns, weights)[0](load)
            finally:
                load.in_flight -= 1

    async def feeder() -> None:
        pace = seconds / pulls_target
        tasks = []
        while loop.time() < until and pulls.callers < pulls_target:
            await gate.wait()
            load.in_flight += 1
            task = asyncio.ensure_future(one_caller(load.chans, load.rng, pulls.callers, pulls, names))
            task.add_done_callback(lambda _: setattr(load, "in_flight", load.in_flight - 1))
            tasks.append(task)
            pulls.callers += 1
            await asyncio.sleep(load.rng.uniform(0, 2 * pace))
        await asyncio.gather(*tasks)

    await asyncio.gather(feeder(), *(worker() for _ in range(WORKERS)))


async def quiet(load: Load, gate: asyncio.Event) -> None:
    gate.clear()
    while load.in_flight:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # let the shim finish what the clients no longer wait for


async def runtime_stats(endpoint: str) -> dict:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return json.loads(await ch.unary_unary(SOAK_STATS)(b"", timeout=5))


@pytest.mark.parametrize("engine", ["relay", "grpc"])
async def test_soak(tmp_path, shim_factory, soak_report, engine: str) -> None:
    seconds = BUDGET / 2
    rt = RuntimeProcess(tmp_path / "rt.sock", soak=True).start()
    chans: list[grpc.aio.Channel] = []
    runner: asyncio.Future[None] | None = None
    try:
        port = free_port()
        shim = shim_factory({"server": {"engine": engine, "admin_socket": ""}, "log": {"level": "warning"},
                             "pulls": {"max_parallel": CAP}, "pins": {"images": ["registry.k8s.io/pause:*"]},
                             "metrics": {"address": f"127.0.0.1:{port}"}}, upstream=rt.socket, log_level="warning")
        chans += [grpc.aio.insecure_channel(shim.endpoint) for _ in range(2)]  # kubelet: runtime + image
        load, pulls, gate = Load(shim.endpoint, chans), Tally(), asyncio.Event()
        if engine == "relay":  # ImageStatus is patched: a malformed request gets the runtime's answer
            async with grpc.aio.insecure_channel(f"unix://{rt.socket}") as direct:
                load.malformed_code, _ = await code_of(direct.unary_unary(SVC + "ImageStatus")(MALFORMED_STATUS,
                                                                                              timeout=10))
            assert load.malformed_code is not grpc.StatusCode.OK
        gate.set()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        until = t0 + seconds
        runner = asyncio.ensure_future(run_load(load, pulls, until, gate, CALLS, PULLS, seconds))
        warm_up = min(max(3.0, seconds * 0.15), seconds / 3)
        await asyncio.sleep(warm_up)
        await quiet(load, gate)
        calls_before = sum(load.done.values())
        rss0, fds0 = rss_and_fds(shim.pid)
        series = [(calls_before, rss0, fds0)]  # (calls, RSS, fds) at quiet moments
        gate.set()
        for i in range(1, 4):  # three more quiet looks along the way
            await asyncio.wait([runner], timeout=max(0.0, t0 + warm_up + (seconds - warm_up) * i / 4 - loop.time()))
            if runner.done():
                break
            await quiet(load, gate)
            series.append((sum(load.done.values()), *rss_and_fds(shim.pid)))
            gate.set()
        await runner
        await quiet(load, gate)
        rss1, fds1 = rss_and_fds(shim.pid)
        series.append((sum(load.done.values()), rss1, fds1))
        elapsed = loop.time() - t0
        for ch in chans:
            await ch.close()
        gauges = await settled_gauges(port)
        stats = await runtime_stats(rt.endpoint)
        calls = sum(load.done.values())
        growth = rss1 - rss0
        soak_report(f"\n[{engine}] soak {elapsed:.1f}s (budget {seconds:.0f}s): {calls} mixed calls "
              f"({calls / elapsed:.0f}/s; {calls - calls_before} after the warm-up), {pulls.callers} pulls "
              f"({dict(sorted(pulls.outcomes.items()))}); runtime pulls {stats['calls']}, at most "
              f"{stats['max_active']} at once (cap {CAP}), {stats['cancelled']} cancelled there\n"
              f"[{engine}] RSS {rss0 / 2**20:.1f} MiB -> {rss1 / 2**20:.1f} MiB ({growth / 2**20:+.1f} MiB), "
              f"{growth / max(1, calls - calls_before):+.0f} bytes per call after the warm-up; "
              f"fds {fds0} -> {fds1}; pull gauges after: {gauges}\n"
              f"[{engine}] (calls, RSS MiB, fds) along the way: "
              f"{[(c, round(r / 2**20, 1), f) for c, r, f in series]}\n"
              f"[{engine}] calls by kind: {dict(load.done)}")
        assert load.unexpected == []
        assert pulls.wrong == []
        assert sum(pulls.outcomes.values()) == pulls.callers
        assert stats["active"] == 0 and stats["max_active"] <= CAP
        assert gauges == {"cri_shim_pulls_in_flight": 0.0, "cri_shim_pull_queue_length": 0.0}
        assert fds1 <= fds0
        assert growth <= 6 * 2**20
        assert shim.running
    finally:
        if runner is not None:
            runner.cancel()
        for ch in chans:  # also when the test failed (closing twice is harmless)
            await ch.close()
        rt.kill()
