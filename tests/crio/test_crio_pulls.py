"""Pull storms through the shim against CRI-O, counted at the registry.

CRI-O collapses identical concurrent pulls by itself (same image string, credentials and
pod namespace); the shim's collapsing adds per-caller deadlines on top. CRI-O has no cap
on images pulled at once; the shim's ``pulls.max_parallel`` holds for it as for containerd.
Blob downloads are held at the registry proxy until every call has reached the shim, so
the pulls overlap for sure.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from tests.support import cri
from tests.support.crio import Crio
from tests.support.oci import PushedImage
from tests.support.proxy import CountingProxy
from tests.support.registry import free_port
from tests.support.shim import ShimProcess

pytestmark = pytest.mark.crio

_TAG_MANIFEST = re.compile(r"/manifests/[^/:?]+(?:\?.*)?$")
# CRI-O reads the manifest by tag twice per pull (once to look at the image, once to
# copy it); containerd once.
PER_PULL = 2


def resolves(proxy: CountingProxy, image: PushedImage) -> int:
    """Answered manifest GETs by tag for ``image``."""
    return sum(1 for r in proxy.records()
               if r.kind == "manifest" and r.method == "GET" and 200 <= r.status < 300
               and _TAG_MANIFEST.search(r.path) and r.image == (image.repository, image.tag))


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)


def start_shim(shim_factory: Callable[..., ShimProcess], max_parallel: int = 4) -> tuple[ShimProcess, int]:
    port = free_port()
    shim = shim_factory({"server": {"admin_socket": ""}, "pulls": {"max_parallel": max_parallel},
                         "metrics": {"address": f"127.0.0.1:{port}"}})

    def answers() -> bool:
        try:
            metric(port, "cri_shim_pull_requests_total")
        except OSError:
            return False
        return True

    wait_for(answers, 10, "the shim's metrics endpoint")
    return shim, port


def storm(pool: ThreadPoolExecutor, socket: object, requests: Sequence[bytes],
          timeouts: Sequence[float] | None = None) -> list[Future[cri.CallResult]]:
    timeouts = timeouts or [120.0] * len(requests)
    return [pool.submit(cri.call, str(socket), "PullImage", r, t) for r, t in zip(requests, timeouts)]


def results(futures: Sequence[Future[cri.CallResult]]) -> list[cri.CallResult]:
    out = [f.result(timeout=120) for f in futures]
    assert all(r.ok for r in out), [r.error_tuple() for r in out if not r.ok]
    return out


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as ex:
        yield ex


def test_identical_pulls_collapse(crio: Crio, shim_factory, make_image, proxy: CountingProxy,
                                  pool: ThreadPoolExecutor) -> None:
    # Directly: CRI-O collapses 12 identical pulls itself.
    direct_img = make_image(filler_bytes=200_000)
    proxy.hold_blobs()
    direct = storm(pool, crio.socket, [cri.pull_image_request(direct_img.ref)] * 12)
    try:
        wait_for(lambda: crio.log_text().count(f"Pulling image: {direct_img.ref}") >= 12, what="12 calls at CRI-O")
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
    finally:
        proxy.release_blobs()
    results(direct)
    assert resolves(proxy, direct_img) == PER_PULL

    # Through the shim: one pull reaches CRI-O, the other 11 join it in the shim.
    shim, port = start_shim(shim_factory)
    img = make_image(filler_bytes=200_000)
    req = cri.pull_image_request(img.ref)
    proxy.reset()
    proxy.hold_blobs()
    via = storm(pool, shim.socket, [req] * 12)
    try:
        wait_for(lambda: metric(port, "cri_shim_pull_requests_total") >= 12, what="12 calls at the shim")
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
    finally:
        proxy.release_blobs()
    answers = results(via)
    assert resolves(proxy, img) == PER_PULL
    assert proxy.stats().blob_bytes == img.image.size
    assert metric(port, "cri_shim_pull_dedup_joins_total") == 11
    assert {r.response for r in answers} == {cri.call(crio.socket, "PullImage", req, 60).response}
    assert cri.decode_pull_image_response(answers[0].unwrap()) == img.digest_ref


def test_short_deadline_caller_leaves_others_get_the_image(crio: Crio, shim_factory, make_image,
                                                           proxy: CountingProxy, pool: ThreadPoolExecutor) -> None:
    """The caller that started the pull gives up. Inside CRI-O alone the pull belongs to
    that call: the two that joined it fail with it. Through the shim it goes on for them."""
    direct_img = make_image(filler_bytes=100_000)
    req = cri.pull_image_request(direct_img.ref)
    proxy.hold_blobs()
    try:
        impatient = storm(pool, crio.socket, [req], [1.5])[0]
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        patient = storm(pool, crio.socket, [req, req])
        wait_for(lambda: crio.log_text().count(f"Pulling image: {direct_img.ref}") >= 3, what="3 calls at CRI-O")
        # CRI-O's gRPC server also times the call out and resets the stream (RST_STREAM CANCEL);
        # whichever side's timer fires first decides the code the client sees
        assert impatient.result(timeout=30).code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
        joined = [f.result(timeout=60) for f in patient]
    finally:
        proxy.release_blobs()
    # the first call's end, as CRI-O saw it first: its deadline or the client's cancel
    ends = {grpc.StatusCode.DEADLINE_EXCEEDED: "context deadline exceeded", grpc.StatusCode.CANCELLED: "context canceled"}
    assert all(r.code in ends and ends[r.code] in (r.details or "") for r in joined), joined

    shim, port = start_shim(shim_factory)
    img = make_image(filler_bytes=100_000)
    req = cri.pull_image_request(img.ref)
    proxy.hold_blobs()
    try:
        impatient = storm(pool, shim.socket, [req], [1.5])[0]
        proxy.wait_until(lambda s: s.inflight_blob_gets >= 1, timeout=30)
        patient = storm(pool, shim.socket, [req, req])
        wait_for(lambda: metric(port, "cri_shim_pull_requests_total") >= 3, what="3 calls at the shim")
        assert impatient.result(timeout=30).code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not any(f.done() for f in patient)
    finally:
        proxy.release_blobs()
    answers = results(patient)
    assert {cri.decode_pull_image_response(r.unwrap()) for r in answers} == {img.digest_ref}
    assert resolves(proxy, img) == PER_PULL and proxy.stats().blob_bytes == img.image.size
    assert metric(port, "cri_shim_pulls_total") == 1


def test_max_parallel_caps_images_downloading_at_once(crio: Crio, shim_factory, make_image,
                                                      proxy: CountingProxy, pool: ThreadPoolExecutor) -> None:
    def requests(images: list[PushedImage]) -> list[bytes]:
        return [cri.pull_image_request(img.ref) for _ in range(3) for img in images]

    # Directly: CRI-O downloads all 4 at once.
    direct_imgs = [make_image(filler_bytes=100_000) for _ in range(4)]
    proxy.hold_blobs()
    direct = storm(pool, crio.socket, requests(direct_imgs))
    try:
        proxy.wait_until(lambda s: s.inflight_images == 4, timeout=30)
    finally:
        proxy.release_blobs()
    results(direct)
    assert proxy.stats().max_concurrent_images == 4

    # Through the shim with max_parallel 2: two at a time.
    shim, port = start_shim(shim_factory, max_parallel=2)
    imgs = [make_image(filler_bytes=100_000) for _ in range(4)]
    proxy.reset()
    proxy.hold_blobs()
    via = storm(pool, shim.socket, requests(imgs))
    try:
        wait_for(lambda: metric(port, "cri_shim_pull_requests_total") >= 12, what="12 calls at the shim")
        stats = proxy.wait_until(lambda s: s.inflight_blob_gets >= 2, timeout=30)
        assert stats.inflight_images == 2
        assert metric(port, "cri_shim_pull_queue_length") == 2
    finally:
        proxy.release_blobs()
    answers = results(via)
    stats = proxy.stats()
    assert stats.max_concurrent_images == 2
    assert stats.blob_bytes == sum(img.image.size for img in imgs)
    assert [cri.decode_pull_image_response(r.unwrap()) for r in answers] == [img.digest_ref for img in imgs] * 3
    assert [resolves(proxy, img) for img in imgs] == [PER_PULL] * 4
