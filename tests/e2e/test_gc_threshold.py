"""Prefetch stops below kubelet's image GC threshold: containerd's root on a 64 MiB tmpfs.

kubelet's config file (written here) says ``imageGCHighThresholdPercent: 60``; a declared set of
six images of ~6 MiB each (incompressible: ~12 MiB on disk with its unpacked copy) does not fit
below it. The shim prefetches images while their manifest sizes fit and no further: the image
filesystem stays at or below the limit, ``cri-shim status`` and the metric say DiskPressure with
the numbers, and a pull by a trusted client (root, as kubelet) still goes through.
Needs root (to mount the tmpfs); the mount is undone after the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.support import binaries, cri
from tests.support.containerd import Containerd
from tests.support.image_fleet import Presence, metric, pinned_set
from tests.support.registry import RegistryWithProxy, free_port
from tests.support.wait import wait_for_blocking as wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]

FS_BYTES = 64 << 20
THRESHOLD = 60
IMAGE_BYTES = 6 << 20
IMAGES = 6


@pytest.fixture
def small_containerd(registry: RegistryWithProxy, tmp_path: Path) -> Iterator[Containerd]:
    workdir = Path(tempfile.mkdtemp(prefix="e2e-gc-"))
    root = workdir / "root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(root)], check=True)
    ctd = Containerd(workdir, binary=binaries.require("containerd"), registries=[registry.host],
                     log_path=tmp_path / "containerd.log")
    try:
        ctd.start()
        yield ctd
    finally:
        ctd.stop()
        subprocess.run(["umount", "-l", str(root)], check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bavail) * st.f_frsize


def test_prefetch_stops_below_the_threshold_and_kubelet_pulls_go_on(
        small_containerd, registry, make_image, shim_factory, tmp_path) -> None:
    images = [make_image(filler_bytes=IMAGE_BYTES) for _ in range(IMAGES)]
    extra = make_image(filler_bytes=IMAGE_BYTES)
    kubelet_config = tmp_path / "kubelet-config.yaml"
    kubelet_config.write_text("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
                              f"imageGCHighThresholdPercent: {THRESHOLD}\n")
    sets = tmp_path / "sets"
    sets.mkdir()
    (sets / "big.yaml").write_text(pinned_set("big", [i.ref for i in images]))
    port = free_port()
    shim = shim_factory({"image_sets": {"dir": str(sets), "max_parallel": 2, "gc_threshold_guard": True,
                                        "kubelet_config_file": str(kubelet_config),
                                        "gc_threshold_margin_percent": 0, "size_factor": 2.0},
                         "pulls": {"max_parallel": 4}, "metrics": {"address": f"127.0.0.1:{port}"}},
                        upstream=small_containerd.socket, log_level="debug")
    root = small_containerd.root
    limit = FS_BYTES * THRESHOLD // 100

    def status() -> dict:
        out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket",
                              shim.config["server"]["admin_socket"]], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["image_sets"]

    def pressure() -> dict:
        return status()["disk"]["gc_threshold"]

    wait_for(lambda: pressure().get("pressure") is True and status()["sets"]["big"]["pulling"] == 0, 120,
             "prefetch held below the threshold")
    s = status()
    row, p = s["sets"]["big"], s["disk"]["gc_threshold"]
    print(f"\npresent {row['present']} of {IMAGES}, used {used(root)} of {FS_BYTES}, limit {limit}; {p['reason']}")
    assert 1 <= row["present"] < IMAGES, shim.log_tail()
    assert used(root) <= limit  # up to the threshold and no further
    assert row["queued"] == IMAGES - row["present"]
    assert p["thresholdPercent"] == THRESHOLD and p["threshold_source"] == str(kubelet_config)
    assert p["thresholdBytes"] == limit
    assert used(root) + 2 * p["sizeBytes"] > limit and p["sizeBytes"] >= IMAGE_BYTES  # the next one would cross
    assert "DiskPressure" in p["reason"] and "DiskPressure" in row["last_error"]
    assert metric(port, "cri_shim_image_set_disk_pressure", {"quantity": "threshold_bytes"}) == limit
    assert metric(port, "cri_shim_image_set_disk_pressure", {"quantity": "waiting"}) == IMAGES - row["present"]

    # a trusted client (root, as kubelet) is never held by the rule
    res = cri.call(shim.socket, "PullImage", cri.pull_image_request(extra.ref), timeout=60)
    res.unwrap()
    assert Presence(str(small_containerd.socket)).present(extra.ref)
    assert status()["sets"]["big"]["present"] == row["present"]  # and prefetch still waits
