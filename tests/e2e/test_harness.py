"""The harness itself, exercised directly against containerd (no shim)."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.support import binaries, cri, oci
from tests.support.containerd import Containerd
from tests.support.fixtures import AUTH_PASSWORD, AUTH_USER
from tests.support.proxy import CountingProxy
from tests.support.registry import RegistryWithProxy

pytestmark = pytest.mark.e2e


def _pull(containerd: Containerd, ref: str, **auth: str) -> cri.CallResult:
    return cri.call(str(containerd.socket), "PullImage", cri.pull_image_request(ref, **auth), timeout=60)


def _status(containerd: Containerd, ref: str) -> cri.ImageInfo | None:
    res = cri.call(str(containerd.socket), "ImageStatus", cri.image_status_request(ref))
    return cri.decode_image_status_response(res.unwrap())


# ---------------------------------------------------------------- basics


def test_version_and_status(containerd: Containerd, cri_call) -> None:
    res = cri_call(containerd.socket, "Version", cri.version_request(), 5)
    assert res.ok, res
    version = cri.decode_version_response(res.response)
    assert version["runtime_name"] == "containerd"
    assert version["runtime_api_version"] == "v1"

    status = cri_call(str(containerd.socket), "/runtime.v1.RuntimeService/Status", b"", 5)
    assert status.ok, status
    assert b"RuntimeReady" in status.response and b"NetworkReady" in status.response

    fsinfo = cri_call(containerd.endpoint, "ImageFsInfo", b"", 5)
    assert fsinfo.ok, fsinfo


def test_unknown_method_error_is_reported(containerd: Containerd, cri_call) -> None:
    res = cri_call(containerd.socket, "/runtime.v1.ImageService/NoSuchMethod", b"", 5)
    assert not res.ok
    assert res.code == grpc.StatusCode.UNIMPLEMENTED
    assert res.response is None


async def test_async_call(containerd: Containerd) -> None:
    res = await cri.acall(str(containerd.socket), "Version", cri.version_request(), timeout=5)
    assert res.ok and cri.decode_version_response(res.response)["runtime_name"] == "containerd"


# ---------------------------------------------------------------- pulling


def test_crictl_pull_is_counted(containerd: Containerd, crictl, make_image, proxy: CountingProxy) -> None:
    img = make_image()
    assert img.ref.startswith(proxy.host + "/")
    assert proxy.stats().manifest_requests == 0, "pushes must bypass the proxy"

    out = crictl.pull(img.ref)
    assert out.returncode == 0, out.stderr
    assert img.image_id in out.stdout

    stats = proxy.stats()
    assert stats.manifest_requests_for(img.repository, img.tag) >= 1
    assert stats.blob_requests_for(img.repository, img.tag) == 2  # config + layer
    assert stats.blob_bytes == img.image.size
    assert stats.max_concurrent_images == 1

    info = _status(containerd, img.ref)
    assert info is not None
    assert info.id == img.image_id
    assert img.ref in info.repo_tags
    assert img.digest_ref in info.repo_digests

    listing = crictl.images("-q")
    assert img.image_id in listing.stdout


def test_raw_pull_list_remove(containerd: Containerd, cri_call, make_image, proxy: CountingProxy) -> None:
    img = make_image(tag="raw")
    res = cri_call(containerd.socket, "PullImage", cri.pull_image_request(img.ref), 60)
    assert res.ok, res
    assert cri.decode_pull_image_response(res.response) == img.image_id
    assert proxy.stats().manifest_requests_for(img.repository, "raw") >= 1

    listed = cri.decode_list_images_response(cri_call(containerd.socket, "ListImages", b"", 10).unwrap())
    assert img.image_id in {i.id for i in listed}
    # (containerd 1.6 ignores the ListImages filter; just check it parses.)
    only = cri_call(containerd.socket, "ListImages", cri.list_images_request(img.ref), 10)
    assert img.image_id in {i.id for i in cri.decode_list_images_response(only.unwrap())}

    # Pulling by digest is attributed to the same image by the proxy.
    proxy.reset()
    res = cri_call(containerd.socket, "PullImage", cri.pull_image_request(img.digest_ref), 60)
    assert res.ok, res
    assert set(proxy.stats().manifests_by_image) <= {(img.repository, "raw")}

    rm = cri_call(containerd.socket, "RemoveImage", cri.remove_image_request(img.image_id), 10)
    assert rm.ok, rm
    assert _status(containerd, img.ref) is None


def test_pull_missing_image_fails(containerd: Containerd, registry: RegistryWithProxy) -> None:
    res = _pull(containerd, f"{registry.host}/e2e/does-not-exist:nope")
    assert not res.ok
    assert res.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN)
    assert "not found" in (res.details or "")


def test_oci_layout_via_skopeo(containerd: Containerd, registry: RegistryWithProxy, tmp_path: Path) -> None:
    import subprocess

    skopeo = binaries.require("skopeo")
    image = oci.make_image()
    oci.write_oci_layout(image, tmp_path / "layout", "t1")
    dest = f"docker://{registry.direct_host}/e2e/skopeo:t1"
    out = subprocess.run(
        [skopeo, "copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'layout'}:t1", dest],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    res = _pull(containerd, f"{registry.host}/e2e/skopeo:t1")
    assert res.ok, res
    assert cri.decode_pull_image_response(res.response) == image.image_id


# ---------------------------------------------------------------- proxy


def test_throttle_slows_pull(containerd: Containerd, make_image, proxy: CountingProxy) -> None:
    fast = make_image(filler_bytes=200_000)
    slow = make_image(filler_bytes=200_000)

    t0 = time.monotonic()
    assert _pull(containerd, fast.ref).ok
    fast_s = time.monotonic() - t0

    proxy.set_throttle(200_000)  # ~1 s for the layer
    t0 = time.monotonic()
    assert _pull(containerd, slow.ref).ok
    slow_s = time.monotonic() - t0

    assert slow_s >= 0.9, slow_s
    assert fast_s < slow_s
    assert proxy.stats().blob_bytes == fast.image.size + slow.image.size


def test_concurrent_images_are_tracked(containerd: Containerd, make_image, proxy: CountingProxy) -> None:
    images = [make_image(filler_bytes=10_000) for _ in range(3)]
    proxy.hold_blobs()
    results: dict[str, cri.CallResult] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i.ref, _pull(containerd, i.ref))) for i in images
    ]
    for t in threads:
        t.start()
    try:
        proxy.wait_until(lambda s: s.inflight_images == 3, timeout=20)
    finally:
        proxy.release_blobs()
        for t in threads:
            t.join(60)
    assert all(r.ok for r in results.values()), results
    stats = proxy.stats()
    assert stats.max_concurrent_images == 3
    assert stats.max_concurrent_repositories == 3
    assert stats.inflight_images == 0

    # Sequential pulls never overlap.
    proxy.reset()
    for img in [make_image() for _ in range(2)]:
        assert _pull(containerd, img.ref).ok
    assert proxy.stats().max_concurrent_images == 1


def test_fault_injection_and_reset(registry: RegistryWithProxy, make_image, proxy: CountingProxy) -> None:
    img = make_image()
    proxy.fail_next("manifest", 1, status=503)
    conn = http.client.HTTPConnection(proxy.host, timeout=10)
    try:
        path = f"/v2/{img.repository}/manifests/{img.tag}"
        headers = {"Accept": oci.MEDIA_OCI_MANIFEST}
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        r.read()
        assert r.status == 503
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        assert r.status == 200
        assert r.read() == img.image.manifest.data
    finally:
        conn.close()
    stats = proxy.stats()
    assert stats.errors_injected == 1
    assert stats.manifest_gets == 2
    proxy.reset()
    assert proxy.stats().manifest_requests == 0


# ---------------------------------------------------------------- auth


def test_auth_registry(containerd: Containerd, crictl, make_image, auth_registry: RegistryWithProxy) -> None:
    img = make_image(registry=auth_registry)
    assert img.ref.startswith(auth_registry.host + "/")
    assert auth_registry.registry.client(authenticated=False).ping() == 401

    denied = crictl.pull(img.ref)
    assert denied.returncode != 0
    assert _status(containerd, img.ref) is None

    ok = crictl.pull(img.ref, creds=f"{AUTH_USER}:{AUTH_PASSWORD}")
    assert ok.returncode == 0, ok.stderr
    assert _status(containerd, img.ref).id == img.image_id

    img2 = make_image(registry=auth_registry)
    wrong = _pull(containerd, img2.ref, username=AUTH_USER, password="wrong")
    assert not wrong.ok
    raw = _pull(containerd, img2.ref, username=AUTH_USER, password=AUTH_PASSWORD)
    assert raw.ok, raw
    assert cri.decode_pull_image_response(raw.response) == img2.image_id


# ---------------------------------------------------------------- restarts


def test_containerd_restart_and_kill(containerd_factory, make_image, crictl_factory) -> None:
    ctd = containerd_factory()
    img = make_image()
    assert _pull(ctd, img.ref).ok
    first_pid = ctd.pid

    ctd.restart()
    assert ctd.pid != first_pid
    assert _status(ctd, img.ref).id == img.image_id
    assert crictl_factory(ctd.socket).images("-q").stdout.count(img.image_id) == 1

    ctd.kill()
    res = cri.call(str(ctd.socket), "Version", b"", timeout=2)
    assert res.code == grpc.StatusCode.UNAVAILABLE
    ctd.start()
    img2 = make_image()
    assert _pull(ctd, img2.ref).ok
    assert _status(ctd, img.ref).id == img.image_id


# ---------------------------------------------------------------- bulk push


def test_push_2000_images_fast(registry: RegistryWithProxy, containerd: Containerd) -> None:
    layer = oci.make_layer({"shared.txt": b"one layer shared by many images"})
    run = f"{time.monotonic_ns():x}"
    # 50 repositories x 40 tags: exercises cross-repo mounts and many tags.
    items = [
        (oci.make_image([layer], unique=f"{run}-{i}"), f"bulk-{run}/repo{i % 50}", f"t{i}") for i in range(2000)
    ]
    t0 = time.monotonic()
    pushed = registry.push_many(items)
    elapsed = time.monotonic() - t0
    assert elapsed < 45, f"pushing 2000 images took {elapsed:.1f}s"
    assert len({p.image_id for p in pushed}) == 2000
    assert len({p.manifest_digest for p in pushed}) == 2000
    # Spot-check: the last one is pullable and has the expected id.
    res = _pull(containerd, pushed[-1].ref)
    assert res.ok, res
    assert cri.decode_pull_image_response(res.response) == pushed[-1].image_id


# ---------------------------------------------------------------- shim fixture


def test_shim_factory_with_passthrough(shim_factory, containerd: Containerd, make_image, cri_call) -> None:
    """``shim_factory`` against a stand-in shim that forwards raw bytes."""
    shim = shim_factory({"example": {"key": 1}}, module="tests.support.passthrough_shim")
    assert shim.running and shim.config_path.read_text().startswith("example:")
    img = make_image()
    pulled = cri_call(shim.socket, "PullImage", cri.pull_image_request(img.ref), 60)
    assert pulled.ok, pulled
    req = cri.image_status_request(img.ref, verbose=False)
    via_shim = cri_call(shim.socket, "ImageStatus", req, 10)
    direct = cri_call(containerd.socket, "ImageStatus", req, 10)
    assert via_shim.response == direct.response
    err_shim = cri_call(shim.socket, "PullImage", cri.pull_image_request(img.ref + "-missing"), 30)
    err_direct = cri_call(containerd.socket, "PullImage", cri.pull_image_request(img.ref + "-missing"), 30)
    assert err_shim.code == err_direct.code and not err_shim.ok
    assert shim.stop() == 0 and not shim.killed
    assert "passthrough shim stopping" in shim.log_text()


def test_shim_factory_with_real_shim(shim_factory, containerd: Containerd, make_image, cri_call) -> None:
    """Smoke test of the ``python -m shim serve`` contract with the real shim."""
    shim = shim_factory({})
    for method, req in (("Version", cri.version_request()), ("ImageFsInfo", b"")):
        via_shim = cri_call(shim.socket, method, req, 10)
        direct = cri_call(containerd.socket, method, req, 10)
        assert via_shim.ok and direct.ok, (via_shim, direct)
        if method == "Version":
            assert via_shim.response == direct.response
    img = make_image()
    pulled = cri_call(shim.socket, "PullImage", cri.pull_image_request(img.ref), 60)
    assert pulled.ok, pulled
    assert cri.decode_pull_image_response(pulled.response) == img.image_id
    req = cri.image_status_request(img.ref)
    assert cri_call(shim.socket, "ImageStatus", req, 10).response == cri_call(containerd.socket, "ImageStatus", req, 10).response
    assert shim.stop() == 0 and not shim.killed


def test_shim_factory_reports_early_exit(shim_factory) -> None:
    with pytest.raises(RuntimeError, match="exited with") as info:
        shim_factory({}, module="tests.support.no_such_module_for_harness_test")
    assert "No module named" in str(info.value)


# ---------------------------------------------------------------- require()


def test_require_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not found"):
        binaries.require("definitely-not-a-binary-xyz")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="not found"):
        binaries.require("definitely-not-a-binary-xyz")
    assert binaries.require("containerd")
