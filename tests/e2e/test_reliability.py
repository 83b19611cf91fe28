"""Faults, bad input and pins end to end: the shim as a process in front of real containerd.

* containerd killed in the middle of a pull storm (pulls in flight, joined, queued):
  every caller gets UNAVAILABLE at once; restarted: the shim serves again within seconds.
* the shim started before containerd, with a storm arriving meanwhile: UNAVAILABLE at once,
  then served (collapsed, capped) as soon as containerd is up.
* containerd stuck on a slow registry: pulls end at their callers' deadlines.
* a pinned image cannot be removed through the shim by any name containerd resolves:
  tags, digest references, IDs with and without ``sha256:``, short ID prefixes, and
  Docker Hub short names (``x`` / ``library/x`` / ``docker.io/library/x`` /
  ``index.docker.io/library/x``, served from the test registry as a docker.io mirror).
* a real authenticated pull logs no credential at debug level.
* a client with keepalive PINGs keeps its connection while the shim answers calls
  itself (containerd's too_many_pings), and an oversized request leaves the
  connection serving.
"""

from __future__ import annotations

import asyncio
import base64
import time
import urllib.request

import grpc
import pytest

from tests.support import cri
from tests.support.cri import timed, until_ok
from tests.support.containerd import Containerd, hosts_toml
from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER
from tests.support.registry import free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.e2e
PULL = "/runtime.v1.ImageService/PullImage"
VERSION = "/runtime.v1.RuntimeService/Version"
PROMPT = 3.0


@pytest.fixture(params=["relay", "grpc"])
def engine(request) -> str:
    return request.param


def gauges(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {n: float(v) for n, _, v in (line.partition(" ") for line in text.splitlines())
            if n in ("cri_shim_pulls_in_flight", "cri_shim_pull_queue_length")}


async def test_containerd_killed_mid_storm_then_restarted(containerd_factory, make_image, proxy, shim_factory,
                                                         engine) -> None:
    ctd = containerd_factory()
    images = [make_image() for _ in range(4)]
    port = free_port()
    shim = shim_factory({"server": {"engine": engine}, "pulls": {"max_parallel": 2},
                         "metrics": {"address": f"127.0.0.1:{port}"}}, upstream=ctd.socket)
    proxy.hold_blobs()
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        pull = ch.unary_unary(PULL)
        first = [images[0]] * 3 + [images[1]] * 2  # in flight, 3 and 2 callers
        calls = [asyncio.ensure_future(timed(lambda: pull(cri.pull_image_request(i.ref), timeout=120))) for i in first]
        await wait_for(lambda: proxy.stats().inflight_images == 2, 15.0, blocking=True, interval=0.05)
        later = [images[2]] * 2 + [images[3]]  # queued, 2 and 1 callers
        calls += [asyncio.ensure_future(timed(lambda: pull(cri.pull_image_request(i.ref), timeout=120))) for i in later]
        await wait_for(lambda: gauges(port) == {"cri_shim_pulls_in_flight": 2.0, "cri_shim_pull_queue_length": 2.0},
                       15.0, blocking=True, interval=0.05)
        assert not any(c.done() for c in calls)

        ctd.kill()
        t_kill = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
        slowest = time.monotonic() - t_kill
        codes = [r.code for r in results]
        print(f"\n[{engine}] containerd killed with 2 pulls in flight (5 callers) and 2 queued (3 callers): "
              f"{[c.name for c in codes]}, all answered within {slowest:.3f}s; details: {results[0].details!r}")
        assert codes == [grpc.StatusCode.UNAVAILABLE] * len(calls)
        assert slowest < PROMPT
        await wait_for(lambda: gauges(port) == {"cri_shim_pulls_in_flight": 0.0, "cri_shim_pull_queue_length": 0.0},
                       15.0, blocking=True, interval=0.05)

        proxy.release_blobs()
        t0 = time.monotonic()
        await asyncio.to_thread(ctd.start)
        ready = time.monotonic() - t0
        t_version = await until_ok(ch, VERSION, b"", timeout=30, call_timeout=30)
        t_pull = await until_ok(ch, PULL, cri.pull_image_request(images[2].ref), timeout=30, call_timeout=30)
        print(f"[{engine}] containerd restarted (ready in {ready:.2f}s): Version through the shim "
              f"{t_version:.3f}s later, a pull done {t_version + t_pull:.3f}s later")
        assert t_version < 5.0
    assert shim.running


async def test_shim_before_containerd_mid_storm(containerd_factory, make_image, proxy, shim_factory, engine) -> None:
    ctd = containerd_factory(start=False)
    images = [make_image() for _ in range(3)]
    shim = shim_factory({"server": {"engine": engine}, "pulls": {"max_parallel": 2}}, upstream=ctd.socket)
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        pull = ch.unary_unary(PULL)
        storm = [timed(lambda i=i: pull(cri.pull_image_request(images[i % 3].ref), timeout=60)) for i in range(9)]
        results = await asyncio.wait_for(asyncio.gather(*storm), 30)
        assert [r.code for r in results] == [grpc.StatusCode.UNAVAILABLE] * 9
        assert max(r.seconds for r in results) < PROMPT
        print(f"\n[{engine}] no containerd yet: 9 pulls UNAVAILABLE within {max(r.seconds for r in results):.3f}s: "
              f"{results[0].details!r}")

        proxy.reset()
        await asyncio.to_thread(ctd.start)
        t_version = await until_ok(ch, VERSION, b"", timeout=30, call_timeout=30)
        t_first = await until_ok(ch, PULL, cri.pull_image_request(images[0].ref), timeout=30, call_timeout=30)
        storm = [timed(lambda i=i: pull(cri.pull_image_request(images[i % 3].ref), timeout=60)) for i in range(9)]
        results = await asyncio.gather(*storm)
        stats = proxy.stats()
        print(f"[{engine}] containerd up: Version through the shim after {t_version:.3f}s, first pull done "
              f"{t_version + t_first:.3f}s; storm of 9 -> {[r.code.name for r in results].count('OK')} OK, "
              f"manifest GETs per image {[stats.manifest_requests_for(i.repository, i.tag) for i in images]}, "
              f"at most {stats.max_concurrent_images} images at once")
        assert [r.code for r in results] == [grpc.StatusCode.OK] * 9
        assert stats.max_concurrent_images <= 2
        assert t_version < 5.0


async def test_slow_registry_pulls_respect_their_deadlines(containerd, make_image, proxy, shim_factory,
                                                           engine) -> None:
    """containerd stuck on a registry: a pull in flight, one joined to it and one queued behind it all
    end at their own deadlines, and the slots come back."""
    a, b = make_image(), make_image()
    port = free_port()
    shim = shim_factory({"server": {"engine": engine}, "pulls": {"max_parallel": 1},
                         "metrics": {"address": f"127.0.0.1:{port}"}})
    proxy.hold_blobs()
    async with grpc.aio.insecure_channel(shim.endpoint) as ch:
        pull = ch.unary_unary(PULL)
        first = asyncio.ensure_future(timed(lambda: pull(cri.pull_image_request(a.ref), timeout=1.5)))
        await wait_for(lambda: proxy.stats().inflight_blob_gets > 0, 15.0, blocking=True, interval=0.05)
        others = await asyncio.gather(timed(lambda: pull(cri.pull_image_request(a.ref), timeout=0.5)),  # joined
                                      timed(lambda: pull(cri.pull_image_request(b.ref), timeout=0.5)))  # queued
        results = [(r.code, r.seconds) for r in (await first, *others)]
        print(f"\n[{engine}] registry stuck: in flight (1.5s), joined (0.5s), queued (0.5s) -> "
              + ", ".join(f"{c.name} after {s:.2f}s" for c, s in results))
        assert [c for c, _ in results] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
        assert 1.5 <= results[0][1] < 2.5 and all(0.5 <= s < 1.5 for _, s in results[1:])
        await wait_for(lambda: gauges(port) == {"cri_shim_pulls_in_flight": 0.0, "cri_shim_pull_queue_length": 0.0},
                       15.0, blocking=True, interval=0.05)
        proxy.release_blobs()
        assert (await timed(lambda: pull(cri.pull_image_request(b.ref), timeout=60)))[0] is grpc.StatusCode.OK


# --------------------------------------------------------------------------- pins by every name


def docker_hub_mirror(ctd: Containerd, host: str) -> None:
    """Let ``docker.io/...`` resolve from the test registry (a mirror in ``certs.d/docker.io``)."""
    d = ctd.certs_dir / "docker.io"
    d.mkdir(parents=True, exist_ok=True)
    (d / "hosts.toml").write_text('server = "https://registry-1.docker.io"\n\n' + hosts_toml(host).split("\n", 2)[2])


def present(ctd: Containerd, image_id: str) -> bool:
    res = cri.call(ctd.socket, "ImageStatus", cri.image_status_request(image_id))
    return cri.decode_image_status_response(res.unwrap()) is not None


def names(img, short: str) -> list[str]:
    """Every name containerd resolves to ``img`` (``short``: its Docker Hub name, e.g. ``pinme-1``)."""
    digest = img.manifest_digest
    hexid = img.image_id.split(":", 1)[1]
    return [
        f"{short}:v1", f"library/{short}:v1", f"docker.io/{short}:v1", f"docker.io/library/{short}:v1",
        f"index.docker.io/library/{short}:v1",
        f"{short}@{digest}", f"docker.io/library/{short}@{digest}", f"{short}:v1@{digest}",
        img.image_id, hexid, hexid[:12], f"sha256:{hexid[:12]}",
    ]


def test_pinned_image_survives_remove_by_every_name(containerd_factory, registry, make_image, shim_factory,
                                                    engine) -> None:
    ctd = containerd_factory()
    docker_hub_mirror(ctd, registry.host)
    short = {}
    imgs = []
    for pin_form in ("short", "full"):
        name = f"pinme-{engine}-{pin_form}-{free_port()}"
        img = make_image(name=f"library/{name}", tag="v1")
        short[img.image_id] = name
        imgs.append(img)
        assert cri.call(ctd.socket, "PullImage", cri.pull_image_request(f"{name}:v1"), timeout=60).ok
    loose = make_image()
    assert cri.call(ctd.socket, "PullImage", cri.pull_image_request(loose.ref), timeout=60).ok
    a, b = imgs
    shim = shim_factory({"server": {"engine": engine},
                         "pins": {"images": [f"{short[a.image_id]}:v1", f"docker.io/library/{short[b.image_id]}:v1"]}},
                        upstream=ctd.socket)
    outcome: dict[str, str] = {}
    for img in (a, b):
        for n in names(img, short[img.image_id]):
            res = cri.call(shim.socket, "RemoveImage", cri.remove_image_request(n))
            outcome[n.replace(short[img.image_id], "X").replace(img.image_id[7:], "<id>")
                    .replace(img.image_id[7:19], "<id12>").replace(img.manifest_digest[7:], "<digest>")] = res.code.name
            assert res.code is grpc.StatusCode.FAILED_PRECONDITION, (n, res)
            assert present(ctd, img.image_id), n
    print(f"\n[{engine}] RemoveImage through the shim: {outcome}")
    # the shim is not refusing everything: an unpinned image goes
    assert cri.call(shim.socket, "RemoveImage", cri.remove_image_request(loose.ref)).ok
    assert not present(ctd, loose.image_id)


# --------------------------------------------------------------------------- credentials, pings, sizes


def test_authenticated_pull_logs_no_credential(containerd, auth_registry, make_image, shim_factory, engine) -> None:
    img = make_image(registry=auth_registry)
    shim = shim_factory({"server": {"engine": engine}}, log_level="debug")
    auth = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    ok = cri.call(shim.socket, "PullImage", cri.pull_image_request(img.ref, username=AUTH_USER,
                                                                    password=AUTH_PASSWORD), timeout=60)
    assert ok.ok, ok
    ok = cri.call(shim.socket, "PullImage", cri.pull_image_request(img.ref, auth=auth), timeout=60)
    assert ok.ok, ok
    denied = cri.call(shim.socket, "PullImage", cri.pull_image_request(img.ref, username=AUTH_USER,
                                                                        password=AUTH_PASSWORD + "-wrong"), timeout=60)
    assert not denied.ok
    tokens = cri.field_bytes(1, cri.image_spec(img.ref)) + cri.field_bytes(2, cri.field_bytes(5, "idtok-Q9-secret")
                                                                             + cri.field_bytes(6, "regtok-W3-secret"))
    cri.call(shim.socket, "PullImage", tokens, timeout=60)
    shim.stop()
    log = shim.log_text()
    assert "level=debug" in log and img.ref in log
    for secret in (AUTH_PASSWORD, auth, "idtok-Q9-secret", "regtok-W3-secret"):
        assert secret not in log
    print(f"\n[{engine}] {len(log.splitlines())} log lines at debug after authenticated pulls: no credential")


async def test_keepalive_client_keeps_its_connection_while_the_shim_answers(containerd, make_image, proxy,
                                                                           shim_factory) -> None:
    """containerd (grpc-go) closes a connection that PINGs it too often while it sends nothing."""
    img = make_image()
    shim = shim_factory({"pins": {"images": [img.ref]}})  # pins: ListImages is answered by the shim
    opts = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]
    proxy.hold_blobs()
    async with grpc.aio.insecure_channel(shim.endpoint, options=opts) as ch:
        assert (await timed(lambda: ch.unary_unary(VERSION)(b"", timeout=10)))[0] is grpc.StatusCode.OK
        held = asyncio.ensure_future(timed(lambda: ch.unary_unary(PULL)(cri.pull_image_request(img.ref), timeout=60)))
        await wait_for(lambda: proxy.stats().inflight_blob_gets > 0, 15.0, blocking=True, interval=0.05)
        for _ in range(15):  # 1.5 s of keepalive PINGs, calls answered by the shim meanwhile
            code, _, details, _ = await timed(lambda: ch.unary_unary("/runtime.v1.ImageService/ListImages")(b"", timeout=10))
            assert code is grpc.StatusCode.OK, details
            await asyncio.sleep(0.1)
        proxy.release_blobs()
        code, _, details, _ = await held
        assert code is grpc.StatusCode.OK, details
        assert (await timed(lambda: ch.unary_unary(VERSION)(b"", timeout=10)))[0] is grpc.StatusCode.OK


async def test_oversized_request_leaves_the_connection_serving(containerd, shim_factory, engine) -> None:
    shim = shim_factory({"server": {"engine": engine, "max_message_bytes": 65536},
                         "pins": {"images": ["registry.k8s.io/pause:*"]}})
    async with grpc.aio.insecure_channel(shim.endpoint, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        for size in (65537, 4 << 20):
            big = cri.pull_image_request("reg.example.com/a:1", annotations={"big": "x" * size})
            code, _, details, _ = await timed(lambda: ch.unary_unary(PULL)(big, timeout=10))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "65536" in details, details
            for method, request in ((VERSION, b""), ("/runtime.v1.ImageService/ListImages", b""),
                                    ("/runtime.v1.ImageService/ImageFsInfo", b"")):
                code, _, details, _ = await timed(lambda: ch.unary_unary(method)(request, timeout=10))
                assert code is grpc.StatusCode.OK, (method, details)
