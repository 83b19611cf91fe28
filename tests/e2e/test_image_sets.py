"""Declared image sets end to end: the shim as a process in front of real containerd.

2,000 small images already in containerd and declared in a PinnedImageSet: the shim
pulls nothing and reports (and serves through ListImages) all 2,000 pinned. Appending
10 pulls exactly those 10; dropping 10 unpins them and leaves them in containerd. A set
edited while its images are being fetched cancels the pulls of the removed images.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from tests.support import binaries, cri
from tests.support.containerd import Containerd
from tests.support.image_fleet import Presence, metric, pinned_set, pull_into, push_fleet
from tests.support.registry import RegistryWithProxy, free_port
from tests.support.wait import wait_for_blocking as wait_for

pytestmark = pytest.mark.e2e

PRESENT = 2000
EXTRA = 10


@pytest.fixture(scope="module")
def fleet(registry: RegistryWithProxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A private containerd holding 2,000 images (pulled directly from the registry, not
    through the counting proxy: faster), and 10 more in the registry, named via the proxy."""
    workdir = tempfile.mkdtemp(prefix="e2e-sets-")
    log = tmp_path_factory.mktemp("containerd-sets") / "containerd.log"
    ctd = Containerd(workdir, binary=binaries.require("containerd"),
                     registries=[registry.host, registry.direct_host], log_path=log)
    try:
        ctd.start()
        pushed = push_fleet(registry, f"sets{os.getpid()}", PRESENT + EXTRA)
        present = pushed[:PRESENT]
        pull_into(str(ctd.socket), [p.with_host(registry.direct_host).ref for p in present], concurrency=32)
        yield SimpleNamespace(containerd=ctd, refs=[p.with_host(registry.direct_host).ref for p in present],
                              ids=[p.image_id for p in present], extra=pushed[PRESENT:])
    finally:
        ctd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def pinned_through_shim(shim) -> dict[str, bool]:
    res = cri.call(shim.socket, "ListImages", cri.list_images_request(), timeout=30)
    return {i.id: i.pinned for i in cri.decode_list_images_response(res.unwrap())}


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_2000_declared_present_then_append_and_drop(fleet, proxy, shim_factory, tmp_path) -> None:
    sets = tmp_path / "sets"
    sets.mkdir()
    release = sets / "release.yaml"
    release.write_text(pinned_set("release", fleet.refs))
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "max_parallel": 4}, "pulls": {"max_parallel": 5},
                         "metrics": {"address": f"127.0.0.1:{port}"}},
                        upstream=fleet.containerd.socket, log_level="info")
    present = {"set": "release", "state": "present"}
    wait_for(lambda: metric(port, "cri_shim_image_set_images", present) == PRESENT, 60, "2,000 reported present")

    # nothing pulled at start, everything pinned, and CRI clients see it pinned
    assert metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) in (None, 0.0)
    assert metric(port, "cri_shim_pulls_total", {"result": "success"}) in (None, 0.0)
    assert metric(port, "cri_shim_image_set_images", {"set": "release", "state": "declared"}) == PRESENT
    listed = pinned_through_shim(shim)
    assert all(listed[i] is True for i in fleet.ids)
    assert "image set progress" in shim.log_text() and "percent=100" in shim.log_text()
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket",
                          shim.config["server"]["admin_socket"]], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)["image_sets"]["sets"]["release"]
    assert (status["declared"], status["present"], status["pinned"], status["failed"]) == (PRESENT, PRESENT, PRESENT, 0)
    assert status["kind"] == "PinnedImageSet" and status["ignored_fields"] == ["metadata.labels"]

    # append 10: exactly those are pulled, soon after the write
    new = [p.ref for p in fleet.extra]
    presence = Presence(str(fleet.containerd.socket))
    try:
        with release.open("a") as f:
            f.write("".join(f"    - name: {r}\n" for r in new))
        took = presence.wait_all(new, timeout=60)
        assert took is not None, shim.log_tail()
        print(f"\n+{EXTRA} at {PRESENT}: all present in containerd {took:.3f} s after the file write")
        wait_for(lambda: metric(port, "cri_shim_image_set_images", present) == PRESENT + EXTRA, 10, "2,010 present")
        assert metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) == EXTRA
        requested = set(proxy.stats().manifests_by_image)
        assert requested == {(p.repository, p.tag) for p in fleet.extra}
        listed = pinned_through_shim(shim)
        assert all(listed[p.image_id] is True for p in fleet.extra)

        # drop 10 of the original ones: unpinned, still present
        dropped = fleet.refs[:10]
        atomic_write(release, pinned_set("release", fleet.refs[10:] + new))

        def dropped_unpinned() -> bool:
            listed = pinned_through_shim(shim)
            return not any(listed[i] for i in fleet.ids[:10])

        wait_for(dropped_unpinned, 30, "10 unpinned")
        assert all(presence.present(r) for r in dropped)
        listed = pinned_through_shim(shim)
        assert all(listed[i] for i in fleet.ids[10:])
        assert metric(port, "cri_shim_image_set_images", {"set": "release", "state": "declared"}) == PRESENT
        assert metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) == EXTRA
    finally:
        presence.close()


def test_edit_while_prefetching_cancels_removed_pulls(containerd, make_image, proxy, shim_factory,
                                                      tmp_path) -> None:
    a, b, c, d = (make_image() for _ in range(4))
    sets = tmp_path / "sets"
    sets.mkdir()
    warm = sets / "warm.yaml"

    def own(*imgs) -> str:
        items = "".join(f"    - name: {i.ref}\n" for i in imgs)
        return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata:\n  name: warm\nspec:\n  images:\n{items}"

    warm.write_text(own(a, b, c, d))
    proxy.hold_blobs()  # pulls resolve their manifest, then wait for their blobs
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "max_parallel": 2, "debounce_seconds": 0.05},
                         "metrics": {"address": f"127.0.0.1:{port}"}})
    proxy.wait_until(lambda s: s.manifest_requests_for(a.repository, a.tag) > 0
                     and s.manifest_requests_for(b.repository, b.tag) > 0, timeout=30)
    time.sleep(0.2)
    assert proxy.stats().manifest_requests_for(c.repository, c.tag) == 0  # c and d wait for a lane

    atomic_write(warm, own(b, d))  # a is being pulled, c is queued: both dropped
    wait_for(lambda: metric(port, "cri_shim_pulls_total", {"result": "cancelled"}) == 1, 30, "a's pull cancelled")
    proxy.release_blobs()
    presence = Presence(str(containerd.socket))
    try:
        assert presence.wait_all([b.ref, d.ref], timeout=60) is not None, shim.log_tail()
        time.sleep(0.5)
        assert not presence.present(a.ref) and not presence.present(c.ref)
    finally:
        presence.close()
    assert proxy.stats().manifest_requests_for(c.repository, c.tag) == 0  # never went upstream
    assert "image dropped from its sets; prefetch cancelled" in shim.log_text()
    assert metric(port, "cri_shim_image_set_images", {"set": "warm", "state": "present"}) == 2
