"""Pull storms through the shim against real containerd (and CRI-O v1.34: the ``crio`` cases)
and a registry that counts requests.

Each test pulls fresh images (containerd has never seen them), holds blob downloads at
the registry proxy until every caller has reached the shim (its metrics say so) or
containerd (the proxy saw every resolve), so the pulls overlap for sure.

A *resolve* is an answered manifest request by tag: containerd makes one per PullImage
(an auth challenge, 401, does not count). CRI-O reads the manifest by tag twice per pull
(GET, once to look at the image, once to copy it), and collapses identical concurrent pulls
by itself (same image string, credentials and pod namespace); the shim's collapsing adds
per-caller deadlines on top. CRI-O has no cap on images pulled at once; the shim's
``pulls.max_parallel`` holds for it as for containerd.
"""

from __future__ import annotations

import asyncio
import base64
import re
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from tests.support import cri
from tests.support.containerd import Containerd
from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER, CRIO, CriRuntime
from tests.support.oci import PushedImage
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy, free_port
from tests.support.shim import ShimProcess
from tests.support.wait import wait_for_blocking as wait_for

# (marked e2e by the folder, the CRI-O cases crio: tests/conftest.py)

#: the runtimes of the runtime-parametrized storms
STORM_RUNTIMES = pytest.mark.parametrize("cri_runtime", ["containerd-1.6", CRIO], indirect=True)

_TAG_MANIFEST = re.compile(r"/manifests/[^/:?]+(?:\?.*)?$")


def resolves(proxy: CountingProxy, image: PushedImage | None = None, method: str | None = None) -> int:
    """Answered manifest requests by tag (for ``image``, or all; only ``method`` ones if given)."""
    return sum(
        1
        for r in proxy.records()
        if r.kind == "manifest" and 200 <= r.status < 300 and _TAG_MANIFEST.search(r.path)
        and (image is None or r.image == (image.repository, image.tag)) and (method is None or r.method == method)
    )


def pull_resolves(runtime: CriRuntime, proxy: CountingProxy, image: PushedImage) -> int:
    """Resolves of ``image`` as the runtime makes them (CRI-O: GETs)."""
    return resolves(proxy, image, "GET" if runtime.is_crio else None)


def per_pull(runtime: CriRuntime) -> int:
    """Resolves one pull makes: containerd 1, CRI-O 2."""
    return 2 if runtime.is_crio else 1


def start_shim(shim_factory: Callable[..., ShimProcess], max_parallel: int = 4,
               upstream: object = None) -> tuple[ShimProcess, int]:
    """A shim in front of ``upstream`` (default: the session containerd), with its metrics on a free port."""
    port = free_port()
    shim = shim_factory({
        "server": {"admin_socket": ""},
        "pulls": {"max_parallel": max_parallel},
        "metrics": {"address": f"127.0.0.1:{port}"},
    }, upstream=upstream)
    wait_for(lambda: _answers(port), timeout=10, what="the shim's metrics endpoint")  # starts after the socket
    return shim, port


def _answers(port: int) -> bool:
    try:
        metric(port, "cri_shim_pull_requests_total")
    except OSError:
        return False
    return True


def metric(port: int, name: str) -> float:
    """A sample of the shim's Prometheus endpoint (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_received(port: int, n: int) -> None:
    """Until the shim has received ``n`` PullImage calls (all joined or queued by then)."""
    wait_for(lambda: metric(port, "cri_shim_pull_requests_total") >= n, timeout=20.0,
             what=f"{n} PullImage calls at the shim")


def storm(pool: ThreadPoolExecutor, socket: object, requests: Sequence[bytes],
          timeouts: Sequence[float] | None = None) -> list[Future[cri.CallResult]]:
    timeouts = timeouts or [120.0] * len(requests)
    return [pool.submit(cri.call, str(socket), "PullImage", req, t) for req, t in zip(requests, timeouts)]


def results(futures: Sequence[Future[cri.CallResult]]) -> list[cri.CallResult]:
    return [f.result(timeout=120) for f in futures]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as ex:
        yield ex


# ---------------------------------------------------------------------------- collapse


@STORM_RUNTIMES
def test_identical_pulls_collapse_into_one_resolve(
    cri_runtime: CriRuntime, shim_factory, make_image, proxy: CountingProxy, pool: ThreadPoolExecutor
) -> None:
    """One pull's resolves (containerd: one, CRI-O: two) for 12 identical calls through the shim."""
    containerd = cri_runtime
    # Directly: 12 concurrent identical pulls, 12 resolves (CRI-O collapses them itself: one pull).
    direct_img = make_image(filler_bytes=200_000)
    proxy.hold_blobs()
    direct = storm(pool, containerd.socket, [cri.pull_image_request(direct_img.ref)] * 12)
    try:
        if cri_runtime.is_crio:
            wait_for(lambda: cri_runtime.instance.log_text().count(f"Pulling image: {direct_img.ref}") >= 12,
                     timeout=20.0, what="12 calls at CRI-O")
            proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        else:
            proxy.wait_until(lambda s: s.manifest_heads >= 12, timeout=30)
    finally:
        proxy.release_blobs()
    assert all(r.ok for r in results(direct))
    assert pull_resolves(cri_runtime, proxy, direct_img) == (per_pull(cri_runtime) if cri_runtime.is_crio else 12)

    # Through the shim: the same storm on a fresh image, one pull.
    proxy.reset()
    shim, port = start_shim(shim_factory, upstream=cri_runtime.socket)
    img = make_image(filler_bytes=200_000)
    req = cri.pull_image_request(img.ref)
    proxy.hold_blobs()
    via_shim = storm(pool, shim.socket, [req] * 12)
    try:
        wait_received(port, 12)
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
    finally:
        proxy.release_blobs()
    answers = results(via_shim)
    assert all(r.ok for r in answers), [r.error_tuple() for r in answers if not r.ok]
    stats = proxy.stats()
    assert pull_resolves(cri_runtime, proxy, img) == per_pull(cri_runtime)
    assert stats.blob_bytes == img.image.size
    assert metric(port, "cri_shim_pull_dedup_joins_total") == 11

    # Every caller got the runtime's answer: what the runtime says for the same pull.
    runtime_answer = cri.call(str(containerd.socket), "PullImage", req, timeout=60)
    assert runtime_answer.ok
    assert {r.response for r in answers} == {runtime_answer.response}
    assert cri.decode_pull_image_response(runtime_answer.response) == cri_runtime.pulled_ref(img)


def test_two_credential_groups_cause_two_resolves(
    containerd: Containerd, shim_factory, make_image, auth_registry: RegistryWithProxy, pool: ThreadPoolExecutor
) -> None:
    proxy = auth_registry.proxy
    assert proxy is not None
    token = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()

    def requests(img: PushedImage) -> list[bytes]:
        # The same user twice: as username/password and as an `auth` token. Both work,
        # and they are different AuthConfigs, so the shim keeps them apart.
        by_password = cri.pull_image_request(img.ref, username=AUTH_USER, password=AUTH_PASSWORD)
        by_token = cri.pull_image_request(img.ref, auth=token)
        return [by_password, by_token] * 6

    proxy.reset()
    direct_img = make_image(registry=auth_registry, filler_bytes=100_000)
    proxy.hold_blobs()
    direct = storm(pool, containerd.socket, requests(direct_img))
    try:
        wait_for(lambda: resolves(proxy, direct_img) >= 12, timeout=20.0, what="12 resolves at the registry")
    finally:
        proxy.release_blobs()
    assert all(r.ok for r in results(direct))
    assert resolves(proxy, direct_img) == 12

    shim, port = start_shim(shim_factory)
    img = make_image(registry=auth_registry, filler_bytes=100_000)
    proxy.reset()
    proxy.hold_blobs()
    via_shim = storm(pool, shim.socket, requests(img))
    try:
        wait_received(port, 12)
    finally:
        proxy.release_blobs()
    answers = results(via_shim)
    assert all(r.ok for r in answers), [r.error_tuple() for r in answers if not r.ok]
    assert {cri.decode_pull_image_response(r.response) for r in answers} == {img.image_id}
    assert resolves(proxy, img) == 2
    assert metric(port, "cri_shim_pulls_total") == 2


# ---------------------------------------------------------------------------- the cap


@STORM_RUNTIMES
def test_max_parallel_caps_images_downloading_at_once(
    cri_runtime: CriRuntime, shim_factory, make_image, proxy: CountingProxy, pool: ThreadPoolExecutor
) -> None:
    containerd = cri_runtime
    def requests(images: list[PushedImage]) -> list[bytes]:
        return [cri.pull_image_request(img.ref) for _ in range(3) for img in images]

    # Directly: all 4 images download at once.
    direct_imgs = [make_image(filler_bytes=100_000) for _ in range(4)]
    proxy.hold_blobs()
    direct = storm(pool, containerd.socket, requests(direct_imgs))
    try:
        proxy.wait_until(lambda s: s.inflight_images == 4, timeout=30)
    finally:
        proxy.release_blobs()
    assert all(r.ok for r in results(direct))
    assert proxy.stats().max_concurrent_images == 4

    # Through the shim with max_parallel 2: two at a time, the others queued.
    shim, port = start_shim(shim_factory, max_parallel=2, upstream=cri_runtime.socket)
    imgs = [make_image(filler_bytes=100_000) for _ in range(4)]
    proxy.reset()
    proxy.hold_blobs()
    via_shim = storm(pool, shim.socket, requests(imgs))
    try:
        wait_received(port, 12)
        stats = proxy.wait_until(lambda s: s.inflight_blob_gets >= 2, timeout=30)
        assert stats.inflight_images == 2
        assert metric(port, "cri_shim_pull_queue_length") == 2
    finally:
        proxy.release_blobs()
    answers = results(via_shim)
    assert all(r.ok for r in answers), [r.error_tuple() for r in answers if not r.ok]
    stats = proxy.stats()
    assert stats.max_concurrent_images == 2
    assert stats.blob_bytes == sum(img.image.size for img in imgs)
    assert [cri.decode_pull_image_response(r.response) for r in answers] == [cri_runtime.pulled_ref(img)
                                                                             for img in imgs] * 3
    assert [pull_resolves(cri_runtime, proxy, img) for img in imgs] == [per_pull(cri_runtime)] * 4


# ---------------------------------------------------------------------------- lifetime


def test_finished_pull_is_not_cached(
    containerd: Containerd, shim_factory, make_image, proxy: CountingProxy
) -> None:
    shim, _ = start_shim(shim_factory)
    img = make_image()
    req = cri.pull_image_request(img.ref)
    first = cri.call(str(shim.socket), "PullImage", req, timeout=60)
    second = cri.call(str(shim.socket), "PullImage", req, timeout=60)
    assert first.ok and second.ok
    assert first.response == second.response
    assert resolves(proxy, img) == 2  # the second pull asked the registry again


@STORM_RUNTIMES
def test_short_deadline_caller_leaves_others_get_the_image(
    cri_runtime: CriRuntime, shim_factory, make_image, proxy: CountingProxy, pool: ThreadPoolExecutor
) -> None:
    """The caller that started the pull gives up; through the shim the pull goes on for the
    two that joined it. (Inside CRI-O alone the pull belongs to that call: they fail with it.)"""
    if cri_runtime.is_crio:
        crio_joiners_fail_with_the_first(cri_runtime, make_image, proxy, pool)
    shim, port = start_shim(shim_factory, upstream=cri_runtime.socket)
    img = make_image(filler_bytes=100_000)
    req = cri.pull_image_request(img.ref)
    proxy.hold_blobs()
    try:
        # The impatient caller starts the pull; two patient ones join it.
        impatient = storm(pool, shim.socket, [req], [1.5])[0]
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        patient = storm(pool, shim.socket, [req, req], [120.0, 120.0])
        wait_received(port, 3)
        late = impatient.result(timeout=30)
        assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not any(f.done() for f in patient)
    finally:
        proxy.release_blobs()
    answers = results(patient)
    assert all(r.ok for r in answers), [r.error_tuple() for r in answers if not r.ok]
    assert {cri.decode_pull_image_response(r.response) for r in answers} == {cri_runtime.pulled_ref(img)}
    assert pull_resolves(cri_runtime, proxy, img) == per_pull(cri_runtime)
    assert proxy.stats().blob_bytes == img.image.size  # the pull went on: downloaded once
    assert metric(port, "cri_shim_pulls_total") == 1


def crio_joiners_fail_with_the_first(crio: CriRuntime, make_image, proxy: CountingProxy,
                                     pool: ThreadPoolExecutor) -> None:
    """CRI-O alone: the first caller's pull times out and the two that joined it fail with it."""
    direct_img = make_image(filler_bytes=100_000)
    req = cri.pull_image_request(direct_img.ref)
    proxy.hold_blobs()
    try:
        impatient = storm(pool, crio.socket, [req], [1.5])[0]
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        patient = storm(pool, crio.socket, [req, req])
        wait_for(lambda: crio.instance.log_text().count(f"Pulling image: {direct_img.ref}") >= 3, timeout=20.0,
                 what="3 calls at CRI-O")
        # CRI-O's gRPC server also times the call out and resets the stream (RST_STREAM CANCEL);
        # whichever side's timer fires first decides the code the client sees
        assert impatient.result(timeout=30).code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        joined = [f.result(timeout=60) for f in patient]
    finally:
        proxy.release_blobs()
    # the first call's end, as CRI-O saw it first: its deadline or the client's cancel
    ends = {grpc.StatusCode.DEADLINE_EXCEEDED: "context deadline exceeded", grpc.StatusCode.CANCELLED: "context canceled"}
    assert all(r.code in ends and ends[r.code] in (r.details or "") for r in joined), joined


# ---------------------------------------------------------------------------- one connection


async def test_waves_of_answers_on_one_connection(
    containerd: Containerd, shim_factory, make_image, proxy: CountingProxy
) -> None:
    """kubelet sends all its image calls on one connection. Pull answers arriving one
    after another make the client PING; containerd must not close that connection for
    "too many pings" (the pulls still waiting on it would fail or start over)."""
    shim, port = start_shim(shim_factory, max_parallel=1)
    imgs = [make_image(filler_bytes=150_000) for _ in range(10)]
    proxy.set_throttle(600_000)  # ~0.25 s per image, one at a time: ten waves of answers
    async with grpc.aio.insecure_channel(f"unix://{shim.socket}") as channel:
        pull = channel.unary_unary("/runtime.v1.ImageService/PullImage")
        calls = [pull(cri.pull_image_request(img.ref), timeout=60) for _ in range(2) for img in imgs]
        answers = await asyncio.gather(*calls, return_exceptions=True)
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors
    assert [cri.decode_pull_image_response(a) for a in answers] == [img.image_id for img in imgs] * 2
    assert [resolves(proxy, img) for img in imgs] == [1] * 10  # no pull cancelled and started over
    assert metric(port, "cri_shim_pulls_total") == 10
    assert "runtime not reachable" not in shim.log_text()
